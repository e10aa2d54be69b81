-- Requests from a file, one per line (GET paths or POST bodies); prints one JSON line.
local reqs = {}
local i = 0
local n_threads = 0
local PCTS = {1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9, 99.99}
local think_ms = 0

function setup(thread)
  thread:set("thread_no", n_threads)
  n_threads = n_threads + 1
end

function init(args)
  local mode, file = args[1], args[2]
  for line in io.lines(file) do
    if mode == "get" then
      reqs[#reqs + 1] = wrk.format("GET", line)
    else
      reqs[#reqs + 1] = wrk.format("POST", "/v1/query",
        {["Content-Type"] = "application/json"}, line)
    end
  end
  i = ((thread_no or 0) * 7919) % #reqs
  think_ms = tonumber(args[3] or "0")
  if think_ms > 0 then
    math.randomseed(17 + (thread_no or 0))
    delay = function() return -math.log(1 - math.random()) * think_ms end
  end
end

function request()
  i = i + 1
  if i > #reqs then i = 1 end
  return reqs[i]
end

function done(summary, latency, requests)
  local e = summary.errors
  local p = {}
  for _, q in ipairs(PCTS) do
    p[#p + 1] = string.format('"%s":%.0f', tostring(q), latency:percentile(q))
  end
  io.write(string.format('SLUICE_WRK {"requests":%.0f,"duration_us":%.0f,"connect":%.0f,'
    .. '"read":%.0f,"write":%.0f,"status":%.0f,"timeout":%.0f,"mean_us":%.1f,"max_us":%.0f,'
    .. '"pct_us":{%s}}\n', summary.requests, summary.duration, e.connect, e.read, e.write,
    e.status, e.timeout, latency.mean, latency.max, table.concat(p, ",")))
end
