# Sourced by the benchmark scripts that start one server at a time on 127.0.0.1:$PORT.
# Callers start a server in the background with `exec` (so $! is the server itself), set PID=$!, call
# `wait_up NAME [SECONDS]` (NAME: its log is $OUT/NAME.log), and `stop` it (also run on exit).

PID=""

stop() {  # TERM the server (background jobs ignore INT), reap it, and wait until the port is closed
  if [[ -n "$PID" ]]; then
    kill -TERM "$PID" 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
    PID=""
    while curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 1; done
  fi
}
trap stop EXIT

wait_up() {  # NAME [SECONDS, default 600]: poll /health until the server answers, or fail if it exits
  for _ in $(seq "${2:-600}"); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    kill -0 "$PID" 2>/dev/null || { echo "server exited; see $OUT/$1.log" >&2; return 1; }
    sleep 1
  done
  echo "server did not come up within ${2:-600} s" >&2
  return 1
}
