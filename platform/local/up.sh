#!/usr/bin/env bash
# Run the platform on this machine: migrate, bootstrap the demo team and secrets,
# start the Celery worker with beat, and serve the ASGI app on 127.0.0.1:8000.
# Ctrl-C stops everything this script started.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=.venv/bin/python
HOST=${PLATFORM_HOST:-127.0.0.1}
PORT=${PLATFORM_PORT:-8000}
# The filesystem broker's folders (no REDIS_URL) are made by config/settings.py.
mkdir -p .local/logs .local/weights

# A persistent secret key for console sessions, kept out of git.
if [ -z "${SECRET_KEY:-}" ] && [ -z "${SECRET_KEY_FILE:-}" ]; then
    if [ ! -s .local/secret_key ]; then
        (umask 077 && $PY -c 'import secrets; print(secrets.token_urlsafe(50))' > .local/secret_key)
    fi
    export SECRET_KEY_FILE=.local/secret_key
fi
export PLATFORM_SERVE_STATIC=${PLATFORM_SERVE_STATIC:-true}
export PLATFORM_ALLOWED_HOSTS=${PLATFORM_ALLOWED_HOSTS:-127.0.0.1,localhost,[::1],$HOST}

$PY manage.py migrate --noinput >.local/logs/migrate.log
CREDS=$($PY manage.py bootstrap_local --json)
field() { printf '%s' "$CREDS" | $PY -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }

# Stop what an earlier run left behind (a killed terminal, a lost session).
mkdir -p .local/run
for pidfile in .local/run/*.pid; do
    [ -e "$pidfile" ] || continue
    kill "$(cat "$pidfile")" 2>/dev/null || true
    rm -f "$pidfile"
done

pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -f .local/run/*.pid
}
trap cleanup EXIT INT TERM HUP

.venv/bin/celery -A config worker -B --concurrency 1 --loglevel INFO \
    >.local/logs/worker.log 2>&1 &
pids+=($!); echo $! >.local/run/worker.pid

# The node agent runs this machine's replicas: two simulated chat-7b and one
# reason-70b, from the pools make up registered.
$PY manage.py engine_agent --node "${PLATFORM_NODE:-local-1}" --gpus "${PLATFORM_NODE_GPUS:-8}" \
    --ports "${PLATFORM_REPLICA_PORTS:-8001-8099}" >.local/logs/agent.log 2>&1 &
AGENT_PID=$!; pids+=($AGENT_PID); echo $AGENT_PID >.local/run/agent.pid

.venv/bin/uvicorn config.asgi:application --host "$HOST" --port "$PORT" \
    --no-access-log --log-level info >.local/logs/server.log 2>&1 &
SERVER_PID=$!; pids+=($SERVER_PID); echo $SERVER_PID >.local/run/server.pid

# Poll until the server answers (or gave up), instead of sleeping a fixed time.
for _ in $(seq 1 150); do
    if $PY - "$HOST" "$PORT" <<'PYEOF' 2>/dev/null; then break; fi
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.2).close()
PYEOF
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "the server failed to start; see .local/logs/server.log" >&2
        tail -n 20 .local/logs/server.log >&2
        exit 1
    fi
    $PY -c 'import time; time.sleep(0.2)'
done

# Wait for the agent to bring the replicas up (it polls their /health).
for _ in $(seq 1 150); do
    serving=$($PY manage.py list_replicas --state serving --count 2>/dev/null || echo 0)
    [ "$serving" -ge 3 ] && break
    if ! kill -0 "$AGENT_PID" 2>/dev/null; then
        echo "the node agent failed; see .local/logs/agent.log" >&2
        tail -n 20 .local/logs/agent.log >&2
        exit 1
    fi
    $PY -c 'import time; time.sleep(0.2)'
done
REPLICAS=$($PY manage.py list_replicas --state serving | sed 's/^/                 /')
CHAT_URL=$($PY manage.py list_replicas --state serving --model chat-7b | awk 'NR==1 {print $3}')

ADMIN_TOKEN=$(field admin_token)
TEAM_KEY=$(field team_key)
# Wait until the gateway routes to the replicas (its snapshot refreshes every 2 s).
for _ in $(seq 1 100); do
    if $PY - "http://$HOST:$PORT" "$TEAM_KEY" <<'PYEOF' 2>/dev/null; then break; fi
import sys, httpx
r = httpx.post(f"{sys.argv[1]}/v1/chat/completions", timeout=5,
               headers={"Authorization": f"Bearer {sys.argv[2]}"},
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
  Metrics        http://$HOST:$PORT/metrics
  Replicas (simulated vLLM, through the node agent):
$REPLICAS
  Logs           .local/logs/{server,worker,agent}.log, .local/logs/replicas/

  Try the control plane:
    curl -s -H "Authorization: Bearer $ADMIN_TOKEN" http://$HOST:$PORT/admin/models/chat-7b
    curl -s -H "Authorization: Bearer $ADMIN_TOKEN" http://$HOST:$PORT/admin/pools/chat-7b/state

  Call the API as team $(field team) (OpenAI-compatible, streaming):
    curl -N http://$HOST:$PORT/v1/chat/completions -H "Authorization: Bearer $TEAM_KEY" \\
      -H 'Content-Type: application/json' -H 'x-conversation-id: demo-1' \\
      -d '{"model": "chat-7b", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "stream": true}'

  Or with the openai SDK:
    .venv/bin/python -c "from openai import OpenAI; c = OpenAI(base_url='http://$HOST:$PORT/v1', api_key='$TEAM_KEY'); r = c.chat.completions.create(model='chat-7b', messages=[{'role': 'user', 'content': 'Hello'}], max_tokens=16); print(r.choices[0].message.content, r.usage)"

  Ctrl-C stops the server, the worker, the agent and its replicas.
BANNER

wait -n "${pids[@]}"
echo "a platform process exited; see .local/logs/" >&2
exit 1
