-- wrk script for the gateway benchmark: POST the body in $WRK_BODY with $WRK_KEY as the key,
-- and print one JSON line of results (latencies in microseconds).
wrk.method = "POST"
wrk.body = os.getenv("WRK_BODY")
wrk.headers["Content-Type"] = "application/json"
local key = os.getenv("WRK_KEY")
if key and key ~= "" then wrk.headers["Authorization"] = "Bearer " .. key end

function done(summary, latency, requests)
  local errors = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "mean_us": %.1f, ' ..
    '"connect_errors": %d, "read_errors": %d, "write_errors": %d, "status_errors": %d, ' ..
    '"timeouts": %d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency.mean, errors.connect, errors.read, errors.write, errors.status, errors.timeout))
end
