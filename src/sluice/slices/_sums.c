/* The query server's most common merge in C: a count's or a sum's slice states, as HMGET
 * returns them, added in slice order.
 *
 * `add_states(replies)` takes a list of stored states (bytes, `token:number`) and Nones (no
 * slice), and returns (states, total): how many states there were and their numbers added one
 * by one in list order as doubles, from -0.0. Each number is read as `float` reads it: short
 * decimals here (`read_decimal`), anything else by PyOS_string_to_double, the parser behind
 * `float`. So the total is what `sluice.slices.state.merge_add_states` gives (docs/metrics.md
 * says why adding as ints where that is exact gives the same total).
 *
 * It returns None for anything it does not read plainly (not a list, an item that is not bytes
 * or None, a state without exactly one ':', a number with spaces or underscores or any text the
 * parser stops short of), and the Python merge then answers, or raises its error. So this
 * module only ever makes a common case faster; it decides nothing on its own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* Decimal texts of up to this many digits (no exponent) are read here: the digits make an
 * integer below 10**15 < 2**53 and the point a power of ten up to 10**15, both exact doubles,
 * so their quotient, rounded once by the division, is the correctly rounded value of the text:
 * what the parser gives (Clinger's fast path), in a fraction of its time. */
#define FAST_DIGITS 15

static const double POWERS[FAST_DIGITS + 1] = {
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
};

static int
read_decimal(const char *text, Py_ssize_t len, double *out)
{
    Py_ssize_t i = 0;
    int negative = 0, digits = 0, fraction = -1; /* digits after the point; -1: no point */
    unsigned long long m = 0;
    if (len > 0 && text[0] == '-') {
        negative = 1;
        i = 1;
    }
    for (; i < len; i++) {
        char c = text[i];
        if (c >= '0' && c <= '9') {
            if (++digits > FAST_DIGITS) {
                return 0;
            }
            m = m * 10 + (unsigned long long)(c - '0');
            if (fraction >= 0) {
                fraction++;
            }
        }
        else if (c == '.' && fraction < 0) {
            fraction = 0;
        }
        else {
            return 0; /* an exponent, a sign inside, a space, a letter: the parser's */
        }
    }
    if (digits == 0) {
        return 0;
    }
    double x = (double)m;
    if (fraction > 0) {
        x /= POWERS[fraction];
    }
    *out = negative ? -x : x; /* "-0" is -0.0, as `float` reads it */
    return 1;
}

static int
read_number(const char *text, Py_ssize_t len, double *out)
{
    if (len <= 0) {
        return 0;
    }
    if (read_decimal(text, len, out)) {
        return 1;
    }
    /* The parser reads up to the first character it cannot take; the text must end there.
     * A bytes object's buffer always ends with a NUL, so the parser stops at its end. */
    char *end = NULL;
    double x = PyOS_string_to_double(text, &end, NULL);
    if (x == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (end != text + len) {
        return 0;
    }
    *out = x;
    return 1;
}

static PyObject *
add_states(PyObject *Py_UNUSED(self), PyObject *replies)
{
    if (!PyList_CheckExact(replies)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(replies), states = 0;
    double total = -0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(replies, i);
        if (item == Py_None) {
            continue;
        }
        if (!PyBytes_CheckExact(item)) {
            Py_RETURN_NONE;
        }
        const char *text = PyBytes_AS_STRING(item);
        Py_ssize_t len = PyBytes_GET_SIZE(item);
        const char *colon = memchr(text, ':', (size_t)len);
        if (colon == NULL) {
            Py_RETURN_NONE;
        }
        const char *number = colon + 1;
        Py_ssize_t number_len = len - (number - text);
        if (memchr(number, ':', (size_t)number_len) != NULL) {
            Py_RETURN_NONE;
        }
        double x;
        if (!read_number(number, number_len, &x)) {
            Py_RETURN_NONE;
        }
        total += x;
        states++;
    }
    return Py_BuildValue("(nd)", states, total);
}

static PyMethodDef methods[] = {
    {"add_states", add_states, METH_O,
     "add_states(replies) -> (states, total) or None: count and sum states added in order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sums", "Count and sum states added in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__sums(void)
{
    return PyModule_Create(&module);
}
