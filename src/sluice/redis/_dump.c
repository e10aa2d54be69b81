/* A backfill's `RESTORE` commands built in C: each new slice hash's DUMP payload, its CRC-64
 * and the RESP-encoded command, appended one hash after another to one growing buffer (each
 * payload measured, then written in place).
 *
 * `restore_commands(...)` (arguments below, and `sluice.pipeline.slice_restore.restore_items`,
 * which calls it) returns (data, offsets): the items back to back, and where each one starts (int64,
 * one more than there are hashes). An item is `RESTORE <name> <expiry> <payload> ABSTTL` in RESP,
 * or with `resp` false the payload alone.
 *
 * A hash is `_b` = the seam, `_m` = "<newest start>:<oldest start>", then its slices in start
 * order. Its payload is the one Redis itself would DUMP for it after building it from the plain
 * hash type: a ziplist (RDB type 13), with every field and value that reads as an integer stored
 * as one (`zip_try_int`, Redis's `zipTryEncoding`), as `ziplistPush` stores it. Loading it is one
 * string to Redis instead of a ziplist grown one push at a time. A hash Redis would not keep as a
 * ziplist (more pairs than `max_entries`, or a field or value longer than `max_value`: the
 * server's `hash-max-ziplist-*`) is written as the plain type (4), and Redis builds its table.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#define TYPE_HASH 4
#define TYPE_HASH_ZIPLIST 13
#define RDB_VERSION 9
#define BIG_PREVLEN 254

/* Slicing by 8 (as Redis's crcspeed): T[0] is the bytewise table, T[k] steps a byte k more. */
static uint64_t CRC_TABLE[8][256];

static void
crc_init(void)
{
    const uint64_t poly = 0x95ac9329ac4bc9b5ULL; /* Jones, reflected */
    for (int i = 0; i < 256; i++) {
        uint64_t c = (uint64_t)i;
        for (int k = 0; k < 8; k++) {
            c = (c & 1) ? (c >> 1) ^ poly : c >> 1;
        }
        CRC_TABLE[0][i] = c;
    }
    for (int k = 1; k < 8; k++) {
        for (int i = 0; i < 256; i++) {
            uint64_t c = CRC_TABLE[k - 1][i];
            CRC_TABLE[k][i] = (c >> 8) ^ CRC_TABLE[0][c & 0xff];
        }
    }
}

static uint64_t
crc64(const unsigned char *p, Py_ssize_t n)
{
    uint64_t crc = 0;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t word = 0;
        for (int i = 0; i < 8; i++) { /* little-endian, whatever the host */
            word |= (uint64_t)p[i] << (8 * i);
        }
        crc ^= word;
        crc = CRC_TABLE[7][crc & 0xff] ^ CRC_TABLE[6][(crc >> 8) & 0xff] ^
              CRC_TABLE[5][(crc >> 16) & 0xff] ^ CRC_TABLE[4][(crc >> 24) & 0xff] ^
              CRC_TABLE[3][(crc >> 32) & 0xff] ^ CRC_TABLE[2][(crc >> 40) & 0xff] ^
              CRC_TABLE[1][(crc >> 48) & 0xff] ^ CRC_TABLE[0][crc >> 56];
    }
    for (; n > 0; n--, p++) {
        crc = CRC_TABLE[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
    }
    return crc;
}

/* Redis's string2ll: a decimal with no sign but '-', no leading zero, within int64. */
static int
text_to_ll(const char *s, Py_ssize_t len, long long *out)
{
    Py_ssize_t i = 0;
    int negative = 0;
    unsigned long long v;
    if (len == 0 || len >= 21) {
        return 0;
    }
    if (len == 1 && s[0] == '0') {
        *out = 0;
        return 1;
    }
    if (s[0] == '-') {
        negative = 1;
        if (++i == len) {
            return 0;
        }
    }
    if (s[i] < '1' || s[i] > '9') {
        return 0;
    }
    v = (unsigned long long)(s[i++] - '0');
    for (; i < len; i++) {
        if (s[i] < '0' || s[i] > '9' || v > ULLONG_MAX / 10) {
            return 0;
        }
        v *= 10;
        if (v > ULLONG_MAX - (unsigned long long)(s[i] - '0')) {
            return 0;
        }
        v += (unsigned long long)(s[i] - '0');
    }
    if (negative) {
        if (v > (unsigned long long)LLONG_MAX + 1) {
            return 0;
        }
        *out = (long long)(0ULL - v);
    }
    else {
        if (v > (unsigned long long)LLONG_MAX) {
            return 0;
        }
        *out = (long long)v;
    }
    return 1;
}

/* How a ziplist stores a text: its encoding byte(s) and data, in `buf` (at most 9 bytes for an
 * integer); returns the length written, or 0 for a text stored as a string. */
static int
zip_try_int(const char *s, Py_ssize_t len, unsigned char *buf)
{
    long long v;
    /* zipTryEncoding also turns away texts of 32 bytes or more; string2ll's 20 are fewer. */
    if (!text_to_ll(s, len, &v)) {
        return 0;
    }
    uint64_t u = (uint64_t)v;
    int size;
    if (v >= 0 && v <= 12) {
        buf[0] = (unsigned char)(0xf1 + v);
        return 1;
    }
    else if (v >= INT8_MIN && v <= INT8_MAX) {
        buf[0] = 0xfe;
        size = 1;
    }
    else if (v >= INT16_MIN && v <= INT16_MAX) {
        buf[0] = 0xc0;
        size = 2;
    }
    else if (v >= -(1 << 23) && v <= (1 << 23) - 1) {
        buf[0] = 0xf0;
        size = 3;
    }
    else if (v >= INT32_MIN && v <= INT32_MAX) {
        buf[0] = 0xd0;
        size = 4;
    }
    else {
        buf[0] = 0xe0;
        size = 8;
    }
    for (int i = 0; i < size; i++) { /* little-endian, the low `size` bytes */
        buf[1 + i] = (unsigned char)(u >> (8 * i));
    }
    return 1 + size;
}

/* One ziplist entry after its prevlen: encoding and data, in `out` (NULL: only measure). */
static Py_ssize_t
zip_body(const char *s, Py_ssize_t len, unsigned char *out)
{
    unsigned char num[9];
    int n = zip_try_int(s, len, num);
    if (n) {
        if (out) {
            memcpy(out, num, (size_t)n);
        }
        return n;
    }
    int head;
    unsigned char h[5];
    if (len <= 0x3f) {
        h[0] = (unsigned char)len;
        head = 1;
    }
    else if (len <= 0x3fff) {
        h[0] = (unsigned char)(0x40 | (len >> 8));
        h[1] = (unsigned char)(len & 0xff);
        head = 2;
    }
    else {
        h[0] = 0x80;
        for (int i = 0; i < 4; i++) {
            h[1 + i] = (unsigned char)((uint64_t)len >> (24 - 8 * i));
        }
        head = 5;
    }
    if (out) {
        memcpy(out, h, (size_t)head);
        memcpy(out + head, s, (size_t)len);
    }
    return head + len;
}

/* An RDB length (6, 14 or 32 bits, big-endian past the first byte) in `out`; its size. */
static Py_ssize_t
rdb_len(uint64_t len, unsigned char *out)
{
    if (len < 64) {
        if (out) {
            out[0] = (unsigned char)len;
        }
        return 1;
    }
    if (len < 16384) {
        if (out) {
            out[0] = (unsigned char)(0x40 | (len >> 8));
            out[1] = (unsigned char)(len & 0xff);
        }
        return 2;
    }
    if (out) {
        out[0] = 0x80;
        for (int i = 0; i < 4; i++) {
            out[1 + i] = (unsigned char)(len >> (24 - 8 * i));
        }
    }
    return 5;
}

typedef struct {
    const char *s;
    Py_ssize_t len;
} Text;

/* `v` in decimal at `out` (at least 20 bytes); its length. */
static int
decimal(long long v, char *out)
{
    char tmp[24];
    int n = 0, k = 0;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        tmp[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) {
        out[k++] = '-';
    }
    while (n) {
        out[k++] = tmp[--n];
    }
    return k;
}

typedef struct {
    const int32_t *name_offsets;
    const char *names;
    const int64_t *expiry;
    const int64_t *bounds;
    const int64_t *starts;
    const int32_t *text_offsets;
    const char *texts;
    Text seam;
    Py_ssize_t max_entries, max_value;
    int resp;
} Input;

/* The texts of hash h's pairs, flattened: field, value, field, value... in `t` (2 * pairs),
 * the start texts written into `digits` (21 bytes per slice, and 43 for `_m`). */
static Py_ssize_t
hash_texts(const Input *in, Py_ssize_t h, Text *t, char *digits)
{
    int64_t a = in->bounds[h], b = in->bounds[h + 1];
    Py_ssize_t n = 0;
    t[n++] = (Text){"_b", 2};
    t[n++] = in->seam;
    t[n++] = (Text){"_m", 2};
    int m = decimal(in->starts[b - 1], digits);
    digits[m++] = ':';
    m += decimal(in->starts[a], digits + m);
    t[n++] = (Text){digits, m};
    digits += 43;
    for (int64_t r = a; r < b; r++) {
        int k = decimal(in->starts[r], digits);
        t[n++] = (Text){digits, k};
        digits += 21;
        t[n++] = (Text){in->texts + in->text_offsets[r], in->text_offsets[r + 1] - in->text_offsets[r]};
    }
    return n;
}

/* Hash h's payload into `out` (NULL: only measure); its size. */
static Py_ssize_t
payload(const Input *in, const Text *t, Py_ssize_t n, unsigned char *out)
{
    Py_ssize_t pairs = n / 2, at = 0;
    int ziplist = pairs <= in->max_entries;
    for (Py_ssize_t i = 0; i < n && ziplist; i++) {
        ziplist = t[i].len <= in->max_value;
    }
    if (out) {
        out[0] = ziplist ? TYPE_HASH_ZIPLIST : TYPE_HASH;
    }
    at = 1;
    if (ziplist) {
        /* header (zlbytes, zltail, zllen), entries, end; as an RDB string */
        Py_ssize_t size = 10, prev = 0, tail = 10;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t e = (prev < BIG_PREVLEN ? 1 : 5) + zip_body(t[i].s, t[i].len, NULL);
            tail = size;
            size += e;
            prev = e;
        }
        size += 1;
        at += rdb_len((uint64_t)size, out ? out + at : NULL);
        if (out) {
            unsigned char *z = out + at;
            for (int i = 0; i < 4; i++) {
                z[i] = (unsigned char)((uint64_t)size >> (8 * i));
                z[4 + i] = (unsigned char)((uint64_t)tail >> (8 * i));
            }
            Py_ssize_t count = n < 0xffff ? n : 0xffff; /* past it, Redis counts by walking */
            z[8] = (unsigned char)(count & 0xff);
            z[9] = (unsigned char)(count >> 8);
            Py_ssize_t p = 10;
            prev = 0;
            for (Py_ssize_t i = 0; i < n; i++) {
                Py_ssize_t start = p;
                if (prev < BIG_PREVLEN) {
                    z[p++] = (unsigned char)prev;
                }
                else {
                    z[p++] = 0xfe;
                    for (int k = 0; k < 4; k++) {
                        z[p++] = (unsigned char)((uint64_t)prev >> (8 * k));
                    }
                }
                p += zip_body(t[i].s, t[i].len, z + p);
                prev = p - start;
            }
            z[p] = 0xff;
        }
        at += size;
    }
    else {
        at += rdb_len((uint64_t)pairs, out ? out + at : NULL);
        for (Py_ssize_t i = 0; i < n; i++) {
            at += rdb_len((uint64_t)t[i].len, out ? out + at : NULL);
            if (out) {
                memcpy(out + at, t[i].s, (size_t)t[i].len);
            }
            at += t[i].len;
        }
    }
    if (out) {
        out[at] = RDB_VERSION;
        out[at + 1] = 0;
        uint64_t crc = crc64(out, at + 2);
        for (int i = 0; i < 8; i++) {
            out[at + 2 + i] = (unsigned char)(crc >> (8 * i));
        }
    }
    return at + 10;
}

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
} Out;

static int
reserve(Out *o, Py_ssize_t extra)
{
    if (o->len + extra <= o->cap) {
        return 0;
    }
    Py_ssize_t cap = o->cap ? o->cap : 1 << 16;
    while (cap < o->len + extra) {
        cap *= 2;
    }
    char *grown = PyMem_Realloc(o->buf, (size_t)cap);
    if (!grown) {
        PyErr_NoMemory();
        return -1;
    }
    o->buf = grown;
    o->cap = cap;
    return 0;
}

static void
put(Out *o, const void *src, Py_ssize_t len)
{
    memcpy(o->buf + o->len, src, (size_t)len);
    o->len += len;
}

static void
put_bulk(Out *o, const char *src, Py_ssize_t len) /* `$<len>\r\n<src>\r\n` */
{
    o->buf[o->len++] = '$';
    o->len += decimal(len, o->buf + o->len);
    put(o, "\r\n", 2);
    if (src) {
        put(o, src, len);
        put(o, "\r\n", 2);
    }
}

/* Hash h (a whole command, or the payload alone) appended to `o`. */
static int
item(const Input *in, Py_ssize_t h, Text *t, char *digits, Out *o)
{
    static const char head[] = "*5\r\n$7\r\nRESTORE\r\n", tail[] = "\r\n$6\r\nABSTTL\r\n";
    Py_ssize_t n = hash_texts(in, h, t, digits);
    Py_ssize_t pl = payload(in, t, n, NULL);
    const char *name = in->names + in->name_offsets[h];
    Py_ssize_t name_len = in->name_offsets[h + 1] - in->name_offsets[h];
    if (reserve(o, pl + name_len + 128) < 0) {
        return -1;
    }
    if (in->resp) {
        char exp[24];
        put(o, head, sizeof head - 1);
        put_bulk(o, name, name_len);
        put_bulk(o, exp, decimal(in->expiry[h], exp));
        put_bulk(o, NULL, pl);
    }
    payload(in, t, n, (unsigned char *)o->buf + o->len);
    o->len += pl;
    if (in->resp) {
        put(o, tail, sizeof tail - 1);
    }
    return 0;
}

static int
view(PyObject *obj, Py_buffer *b, Py_ssize_t item_size, Py_ssize_t at_least, const char *what)
{
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    if (b->len % item_size || b->len / item_size < at_least) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected at least %zd items of %zd",
                     what, b->len, at_least, item_size);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static PyObject *
restore_commands(PyObject *self, PyObject *args)
{
    PyObject *o[7];
    Py_buffer seam;
    Py_ssize_t max_entries, max_value;
    int resp;
    if (!PyArg_ParseTuple(args, "OOOOOOOy*nnp", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6],
                          &seam, &max_entries, &max_value, &resp)) {
        return NULL;
    }
    Py_buffer b[7];
    int got = 0;
    PyObject *result = NULL, *data = NULL, *offsets = NULL;
    Out out = {NULL, 0, 0};
    Text *t = NULL;
    char *digits = NULL;
    Py_ssize_t widest = 0;
    /* bounds first: it says how many hashes and rows there are */
    if (view(o[3], &b[3], 8, 1, "bounds") < 0) {
        goto done;
    }
    got |= 1 << 3;
    Py_ssize_t hashes = b[3].len / 8 - 1;
    const int64_t *bounds = b[3].buf;
    Py_ssize_t rows = bounds[hashes];
    struct {
        int i;
        Py_ssize_t size, count;
        const char *what;
    } specs[] = {
        {0, 4, hashes + 1, "name offsets"}, {1, 1, 0, "names"}, {2, 8, hashes, "expiry"},
        {4, 8, rows, "starts"}, {5, 4, rows + 1, "text offsets"}, {6, 1, 0, "texts"},
    };
    for (size_t k = 0; k < sizeof specs / sizeof specs[0]; k++) {
        if (view(o[specs[k].i], &b[specs[k].i], specs[k].size, specs[k].count, specs[k].what) < 0) {
            goto done;
        }
        got |= 1 << specs[k].i;
    }
    Input in = {
        b[0].buf, b[1].buf, b[2].buf, bounds, b[4].buf, b[5].buf, b[6].buf,
        {seam.buf, seam.len}, max_entries, max_value, resp,
    };
    if (in.name_offsets[0] < 0 || in.text_offsets[0] < 0) {
        PyErr_SetString(PyExc_ValueError, "offsets must start at 0 or after");
        goto done;
    }
    for (Py_ssize_t h = 0; h < hashes; h++) {
        if (bounds[h + 1] <= bounds[h] || bounds[h] < 0 || bounds[h + 1] > rows) {
            PyErr_SetString(PyExc_ValueError, "bounds: every hash needs rows, in order");
            goto done;
        }
        if (in.name_offsets[h + 1] < in.name_offsets[h] || in.name_offsets[h + 1] > b[1].len) {
            PyErr_SetString(PyExc_ValueError, "name offsets out of range");
            goto done;
        }
        if (bounds[h + 1] - bounds[h] > widest) {
            widest = bounds[h + 1] - bounds[h];
        }
    }
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (in.text_offsets[r + 1] < in.text_offsets[r] || in.text_offsets[r + 1] > b[6].len) {
            PyErr_SetString(PyExc_ValueError, "text offsets out of range");
            goto done;
        }
    }
    t = PyMem_Malloc(sizeof(Text) * (size_t)(2 * widest + 4));
    digits = PyMem_Malloc((size_t)(43 + 21 * widest));
    offsets = PyBytes_FromStringAndSize(NULL, 8 * (hashes + 1));
    if (!t || !digits || !offsets) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *off = (int64_t *)PyBytes_AS_STRING(offsets);
    off[0] = 0;
    for (Py_ssize_t h = 0; h < hashes; h++) {
        if (item(&in, h, t, digits, &out) < 0) {
            goto done;
        }
        off[h + 1] = out.len;
    }
    data = PyBytes_FromStringAndSize(out.buf ? out.buf : "", out.len);
    if (!data) {
        goto done;
    }
    result = PyTuple_Pack(2, data, offsets);
done:
    for (int i = 0; i < 7; i++) {
        if (got & (1 << i)) {
            PyBuffer_Release(&b[i]);
        }
    }
    PyBuffer_Release(&seam);
    PyMem_Free(t);
    PyMem_Free(digits);
    PyMem_Free(out.buf);
    Py_XDECREF(data);
    Py_XDECREF(offsets);
    return result;
}

static PyObject *
crc64_py(PyObject *self, PyObject *arg)
{
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    uint64_t crc = crc64(b.buf, b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(crc);
}

static PyMethodDef METHODS[] = {
    {"restore_commands", restore_commands, METH_VARARGS,
     "restore_commands(name_offsets, names, expiry, bounds, starts, text_offsets, texts, seam,"
     " max_entries, max_value, resp) -> (data, offsets): a backfill's RESTOREs (or payloads)."},
    {"crc64", crc64_py, METH_O, "crc64(data) -> int: Redis's CRC-64 (Jones) of a buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_dump", NULL, -1, METHODS};

PyMODINIT_FUNC
PyInit__dump(void)
{
    crc_init();
    return PyModule_Create(&MODULE);
}
