-- wrk script: keep-alive POST /stage for one adapter; prints one JSON line of results.
wrk.method = "POST"
wrk.body = '{"adapter_id": "' .. os.getenv("LSBENCH_ADAPTER_ID") .. '"}'
wrk.headers["Content-Type"] = "application/json"
if os.getenv("LSBENCH_AUTHORIZATION") then
  wrk.headers["Authorization"] = os.getenv("LSBENCH_AUTHORIZATION")
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "socket_errors": %d, "status_errors": %d, ' ..
    '"p50_us": %d, "p99_us": %d}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
