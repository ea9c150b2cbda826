#!/usr/bin/env bash
# Run the platform on this machine: migrate, bootstrap the demo team and secrets,
# start the Celery worker with beat, and serve the ASGI app on 127.0.0.1:8000.
# Ctrl-C (or SIGTERM) stops everything this script started and exits 0; a platform
# process that dies on its own ends the script with 1.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=.venv/bin/python
HOST=${PLATFORM_HOST:-127.0.0.1}
PORT=${PLATFORM_PORT:-8000}
# Logs, pid files, credentials and the beat schedule (a second `make up` beside the
# first, as tests/test_make_up.py runs one, needs its own).
LOCAL=${PLATFORM_LOCAL_DIR:-.local}
# The filesystem broker's folders (no REDIS_URL) are made by config/settings.py.
mkdir -p "$LOCAL/logs" .local/weights

# A persistent secret key for console sessions, kept out of git.
if [ -z "${SECRET_KEY:-}" ] && [ -z "${SECRET_KEY_FILE:-}" ]; then
    if [ ! -s "$LOCAL/secret_key" ]; then
        (umask 077 && $PY -c 'import secrets; print(secrets.token_urlsafe(50))' > "$LOCAL/secret_key")
    fi
    export SECRET_KEY_FILE=$LOCAL/secret_key
fi
export PLATFORM_SERVE_STATIC=${PLATFORM_SERVE_STATIC:-true}
export PLATFORM_ALLOWED_HOSTS=${PLATFORM_ALLOWED_HOSTS:-127.0.0.1,localhost,[::1],$HOST}

pids=()
cleanup() {
    trap '' INT  # a second Ctrl-C must not cut the stop short
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    # Waits for the agent too, which stops its replicas before it exits.
    wait 2>/dev/null || true
    pids=()
    rm -f "$LOCAL"/run/*.pid
}
stop() {
    # `|| true`: after a hang-up the terminal is gone and writing to it fails.
    printf '\nstopping the platform (server, worker, agent and replicas)...\n' || true
    cleanup
    echo "stopped." || true
    exit 0
}
trap cleanup EXIT
trap stop INT TERM HUP

$PY manage.py migrate --noinput >"$LOCAL/logs/migrate.log"
CREDS=$($PY manage.py bootstrap_local --json --credentials "$LOCAL/credentials.json")
field() { printf '%s' "$CREDS" | $PY -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }

# The engine key (replicas demand it on /v1, the gateway sends it), the simulated
# replicas' admin token (/sim/faults) and the metrics token: made once by
# bootstrap_local and kept in credentials.json (mode 600). They reach the processes
# in their environment, never their argv, which anyone on the host can read in the
# process list. A variable the operator set (NAME or NAME_FILE) is left alone.
use_secret() {
    local name=$1 file_name="$1_FILE"
    if [ -z "${!name:-}" ] && [ -z "${!file_name:-}" ]; then
        export "$name=$(field "$2")"
    fi
}
use_secret PLATFORM_ENGINE_API_KEY engine_api_key
use_secret PLATFORM_SIM_ADMIN_TOKEN sim_admin_token
use_secret PLATFORM_METRICS_TOKEN metrics_token

# Stop what an earlier run left behind (a killed terminal, a lost session).
mkdir -p "$LOCAL/run"
for pidfile in "$LOCAL"/run/*.pid; do
    [ -e "$pidfile" ] || continue
    kill "$(cat "$pidfile")" 2>/dev/null || true
    rm -f "$pidfile"
done

# Each process runs in a session of its own, so signals reach it from this script
# only: Ctrl-C or a closed terminal comes here, and `stop` sends each one SIGTERM
# (Celery takes a terminal's SIGHUP as "restart", which would outlive the stop).
SETSID=$(command -v setsid || true)

$SETSID .venv/bin/celery -A config worker -B -Q celery --concurrency 1 --loglevel INFO \
    --schedule "$LOCAL/celerybeat-schedule" </dev/null >"$LOCAL/logs/worker.log" 2>&1 &
pids+=($!); echo $! >"$LOCAL/run/worker.pid"

# The version gates run for minutes to hours: a worker of their own (queue gates),
# so the control loops' ticks never wait behind them. Their eval prompts go
# through this server.
PLATFORM_GATE_GATEWAY_URL="${PLATFORM_GATE_GATEWAY_URL:-http://$HOST:$PORT}" \
$SETSID .venv/bin/celery -A config worker -Q gates --concurrency 1 --loglevel INFO \
    -n "gates@%h" </dev/null >"$LOCAL/logs/gates-worker.log" 2>&1 &
pids+=($!); echo $! >"$LOCAL/run/gates-worker.pid"

# Batch runners work a job for minutes at a time (queue batches): two at once,
# each sending its lines through this server at the batch tier.
PLATFORM_BATCH_GATEWAY_URL="${PLATFORM_BATCH_GATEWAY_URL:-http://$HOST:$PORT}" \
$SETSID .venv/bin/celery -A config worker -Q batches --concurrency 2 --loglevel INFO \
    -n "batches@%h" </dev/null >"$LOCAL/logs/batches-worker.log" 2>&1 &
pids+=($!); echo $! >"$LOCAL/run/batches-worker.pid"

# The node agent runs this machine's replicas: two simulated chat-7b and one
# reason-70b, from the pools make up registered.
$SETSID $PY manage.py engine_agent --node "${PLATFORM_NODE:-local-1}" --gpus "${PLATFORM_NODE_GPUS:-8}" \
    --ports "${PLATFORM_REPLICA_PORTS:-8001-8099}" --log-dir "$LOCAL/logs/replicas" \
    </dev/null >"$LOCAL/logs/agent.log" 2>&1 &
AGENT_PID=$!; pids+=($AGENT_PID); echo $AGENT_PID >"$LOCAL/run/agent.pid"

$SETSID .venv/bin/uvicorn config.asgi:application --host "$HOST" --port "$PORT" \
    --no-access-log --log-level info </dev/null >"$LOCAL/logs/server.log" 2>&1 &
SERVER_PID=$!; pids+=($SERVER_PID); echo $SERVER_PID >"$LOCAL/run/server.pid"

# Poll until the server answers (or gave up), instead of sleeping a fixed time.
for _ in $(seq 1 150); do
    if $PY - "$HOST" "$PORT" <<'PYEOF' 2>/dev/null; then break; fi
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.2).close()
PYEOF
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "the server failed to start; see $LOCAL/logs/server.log" >&2
        tail -n 20 "$LOCAL/logs/server.log" >&2
        exit 1
    fi
    $PY -c 'import time; time.sleep(0.2)'
done

# Wait for the agent to bring the replicas up (it polls their /health).
for _ in $(seq 1 150); do
    serving=$($PY manage.py list_replicas --state serving --count 2>/dev/null || echo 0)
    [ "$serving" -ge 3 ] && break
    if ! kill -0 "$AGENT_PID" 2>/dev/null; then
        echo "the node agent failed; see $LOCAL/logs/agent.log" >&2
        tail -n 20 "$LOCAL/logs/agent.log" >&2
        exit 1
    fi
    $PY -c 'import time; time.sleep(0.2)'
done
REPLICAS=$($PY manage.py list_replicas --state serving | sed 's/^/                 /')
CHAT_URL=$($PY manage.py list_replicas --state serving --model chat-7b | awk 'NR==1 {print $3}')

ADMIN_TOKEN=$(field admin_token)
TEAM_KEY=$(field team_key)
METRICS_TOKEN=$PLATFORM_METRICS_TOKEN
SIM_ADMIN_TOKEN=$PLATFORM_SIM_ADMIN_TOKEN
# Wait until the gateway routes to the replicas (its snapshot refreshes every 2 s).
# The key goes in the environment: argv would show it in the process list.
for _ in $(seq 1 100); do
    if PROBE_KEY=$TEAM_KEY $PY - "http://$HOST:$PORT" <<'PYEOF' 2>/dev/null; then break; fi
import os, sys, httpx
r = httpx.post(f"{sys.argv[1]}/v1/chat/completions", timeout=5,
               headers={"Authorization": f"Bearer {os.environ['PROBE_KEY']}"},
               json={"model": "chat-7b", "messages": [{"role": "user", "content": "ping"}],
                     "max_tokens": 1})
sys.exit(0 if r.status_code == 200 else 1)
PYEOF
    $PY -c 'import time; time.sleep(0.2)'
done
cat <<BANNER

  Serving platform is up (region ${PLATFORM_REGION:-local}).

  Console        http://$HOST:$PORT/console/
                 user $(field console_user), password $(field console_password)
  Admin token    $ADMIN_TOKEN
  Team key       $TEAM_KEY   (team $(field team))
  Metrics token  $METRICS_TOKEN
                 curl -s -H "Authorization: Bearer $METRICS_TOKEN" http://$HOST:$PORT/metrics
  Replicas (simulated vLLM, through the node agent; /v1 needs the engine key):
$REPLICAS
  Engine key and the replicas' admin token: $LOCAL/credentials.json (mode 600)
  Logs           $LOCAL/logs/{server,worker,gates-worker,batches-worker,agent}.log, $LOCAL/logs/replicas/

  Try the control plane:
    curl -s -H "Authorization: Bearer $ADMIN_TOKEN" http://$HOST:$PORT/admin/models/chat-7b
    curl -s -H "Authorization: Bearer $ADMIN_TOKEN" http://$HOST:$PORT/admin/pools/chat-7b/state

  Call the API as team $(field team) (OpenAI-compatible, streaming):
    curl -N http://$HOST:$PORT/v1/chat/completions -H "Authorization: Bearer $TEAM_KEY" \\
      -H 'Content-Type: application/json' -H 'x-conversation-id: demo-1' \\
      -d '{"model": "chat-7b", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "stream": true}'

  Or with the openai SDK:
    .venv/bin/python -c "from openai import OpenAI; c = OpenAI(base_url='http://$HOST:$PORT/v1', api_key='$TEAM_KEY'); r = c.chat.completions.create(model='chat-7b', messages=[{'role': 'user', 'content': 'Hello'}], max_tokens=16); print(r.choices[0].message.content, r.usage)"

  Run a batch on idle capacity (OpenAI's Batch API; lines are checked at creation):
    .venv/bin/python -c "import json, io; from openai import OpenAI; c = OpenAI(base_url='http://$HOST:$PORT/v1', api_key='$TEAM_KEY'); f = c.files.create(file=('in.jsonl', io.BytesIO(b''.join(json.dumps({'custom_id': f'q{i}', 'method': 'POST', 'url': '/v1/chat/completions', 'body': {'model': 'chat-7b', 'messages': [{'role': 'user', 'content': f'Question {i}'}], 'max_tokens': 16}}).encode() + b'\\n' for i in range(20)))), purpose='batch'); print(c.batches.create(input_file_id=f.id, endpoint='/v1/chat/completions', completion_window='1h'))"

  Inject a fault into a replica (the next request fails before its first token):
    curl -s -H "Authorization: Bearer $SIM_ADMIN_TOKEN" $CHAT_URL/sim/faults -d '{"fail_next": 1}'

  Ctrl-C stops the server, the workers, the agent and its replicas.
BANNER

# Ctrl-C runs `stop` (exit 0) from inside this wait; getting past it means a
# process exited on its own.
status=0
wait -n "${pids[@]}" || status=$?
echo "a platform process exited (status $status); see $LOCAL/logs/" >&2
exit 1
