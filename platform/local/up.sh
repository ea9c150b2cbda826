#!/usr/bin/env bash
# Run the platform on this machine: migrate, bootstrap the demo team and secrets,
# start the Celery worker with beat, and serve the ASGI app on 127.0.0.1:8000.
# Ctrl-C (or SIGTERM) stops everything this script started and exits 0; a platform
# process that dies on its own ends the script with 1.
set -euo pipefail
cd "$(dirname "$0")/../.."

# Started as a background job of a script (`make up &`), this shell inherits SIGINT
# ignored, and bash cannot trap a signal ignored when it started: start again with
# it reset, so that Ctrl-C or a wrapper's SIGINT stops the platform.
if [ -z "${PLATFORM_UP_SIGNALS_RESET:-}" ] && [ -n "$(trap -p INT)" ]; then
    export PLATFORM_UP_SIGNALS_RESET=1
    exec python3 -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execvp("bash", ["bash", *sys.argv[1:]])' "$0" "$@"
fi

PY=.venv/bin/python
HOST=${PLATFORM_HOST:-127.0.0.1}
PORT=${PLATFORM_PORT:-8000}
# REGIONS=2 runs two regions on this machine behind HAProxy (the global load
# balancer): per region a gateway, a worker with beat, a node agent and a Redis
# logical database, with the one PostgreSQL control plane. Clients dial their
# region's frontend: $PORT (the first region) and $PORT+1 (the second).
REGIONS=${REGIONS:-1}
if [ "$REGIONS" = 1 ]; then
    REGION_NAMES=("${PLATFORM_REGION:-local}")
elif [ "$REGIONS" = 2 ]; then
    read -r -a REGION_NAMES <<<"${PLATFORM_REGION_NAMES:-east west}"
    [ "${#REGION_NAMES[@]}" = 2 ] || { echo "PLATFORM_REGION_NAMES needs two names" >&2; exit 2; }
else
    echo "REGIONS is 1 or 2, not $REGIONS" >&2
    exit 2
fi
export PLATFORM_REGION=${REGION_NAMES[0]}
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
# How long a stop waits for each process to finish by itself (the agent stops its
# replicas, a worker its task, the server its open streams) before killing it.
STOP_GRACE_S=${PLATFORM_UP_STOP_GRACE_S:-20}
is_alive() {  # a child that exited is a zombie until waited for: not alive
    local state
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}
name_of() {  # the pid file that names a pid: server, worker, agent...
    grep -lx "$1" "$LOCAL"/run/*.pid 2>/dev/null | head -n 1 | xargs -r basename -s .pid
}
cleanup() {
    trap '' INT TERM HUP  # a second Ctrl-C must not cut the stop short
    [ -z "${WATCHER:-}" ] || kill "$WATCHER" 2>/dev/null || true
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    local deadline=$((SECONDS + STOP_GRACE_S)) left=() pid
    while :; do
        left=()
        for pid in "${pids[@]}"; do is_alive "$pid" && left+=("$pid"); done
        [ "${#left[@]}" -gt 0 ] && [ "$SECONDS" -lt "$deadline" ] || break
        sleep 0.2
    done
    # Each runs in a session of its own (setsid): its process group goes with it.
    for pid in "${left[@]}"; do
        echo "$(name_of "$pid") (pid $pid) did not stop within $STOP_GRACE_S s; killing it" >&2 || true
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    done
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

# Whatever started this script (make, a wrapper) dying must not leave the platform
# running: a wrapper that interrupts make and then kills it (make ignores SIGINT as
# a background job, and forwards only SIGTERM) would orphan every process here.
# The watcher stops the platform when that parent is gone.
UP_PARENT=${PLATFORM_UP_PARENT:-$PPID}
(
    trap - INT TERM HUP EXIT
    while kill -0 "$UP_PARENT" 2>/dev/null; do sleep 1; done
    kill -TERM $$ 2>/dev/null
) </dev/null >/dev/null 2>&1 &
WATCHER=$!

# Stop what an earlier run left behind (a killed terminal, a lost session).
mkdir -p "$LOCAL/run"
for pidfile in "$LOCAL"/run/*.pid; do
    [ -e "$pidfile" ] || continue
    kill "$(cat "$pidfile")" 2>/dev/null || true
    rm -f "$pidfile"
done

# The ports this run serves on must be free: another platform (or anything) on
# them would answer instead, with other credentials. Refuse before starting anything.
if [ "$REGIONS" = 2 ]; then
    WANTED_PORTS="$PORT $((PORT + 1)) ${PLATFORM_GATEWAY_PORTS:-$((PORT + 10)) $((PORT + 20))}"
else
    WANTED_PORTS=$PORT
fi
# shellcheck disable=SC2086
if ! TAKEN=$($PY -m localrun.up_checks ports "$HOST" $WANTED_PORTS); then
    printf 'make up: cannot start, %s\n' "$TAKEN" >&2
    printf 'make up: stop what holds it, or choose others (PLATFORM_PORT=%s)\n' "$((PORT + 100))" >&2
    trap - EXIT
    kill "$WATCHER" 2>/dev/null || true
    exit 1
fi

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

# Each process runs in a session of its own, so signals reach it from this script
# only: Ctrl-C or a closed terminal comes here, and `stop` sends each one SIGTERM
# (Celery takes a terminal's SIGHUP as "restart", which would outlive the stop).
SETSID=$(command -v setsid || true)

# Per region: its Redis (a logical database of REDIS_URL's server, one each when
# there are two), its gateway's port and its replicas' ports.
if [ "$REGIONS" = 2 ]; then
    BASE_REDIS=${REDIS_URL:-redis://127.0.0.1:6379/0}
    if ! $PY -c 'import redis, sys; redis.Redis.from_url(sys.argv[1], socket_connect_timeout=2).ping()' "$BASE_REDIS" 2>/dev/null; then
        echo "REGIONS=2 needs Redis (each region's limits, live load and broker): none at $BASE_REDIS" >&2
        exit 1
    fi
    REDIS_HEAD=${BASE_REDIS%/*}; REDIS_DB=${BASE_REDIS##*/}
    [[ "$REDIS_DB" =~ ^[0-9]+$ ]] || { REDIS_HEAD=$BASE_REDIS; REDIS_DB=0; }
    read -r -a GATEWAY_PORTS <<<"${PLATFORM_GATEWAY_PORTS:-$((PORT + 10)) $((PORT + 20))}"
    read -r -a REPLICA_PORTS <<<"${PLATFORM_REPLICA_PORTS:-8101-8199 8201-8299}"
    [ "${#REPLICA_PORTS[@]}" = 2 ] || { echo "PLATFORM_REPLICA_PORTS needs two ranges" >&2; exit 2; }
else
    GATEWAY_PORTS=("$PORT")
    REPLICA_PORTS=("${PLATFORM_REPLICA_PORTS:-8001-8099}")
fi
region_redis() {  # region_redis INDEX: the region's REDIS_URL ("" without Redis)
    if [ "$REGIONS" = 2 ]; then echo "$REDIS_HEAD/$(((REDIS_DB + $1) % 16))"; else echo "${REDIS_URL:-}"; fi
}
# run_in NAME INDEX LOG PIDNAME COMMAND...: start COMMAND in region INDEX's
# environment, in a session of its own, logging to LOG; remember its pid.
run_in() {
    local name=$1 index=$2 log=$3 pidname=$4; shift 4
    PLATFORM_REGION=$name REDIS_URL=$(region_redis "$index") \
        $SETSID "$@" </dev/null >"$LOCAL/logs/$log" 2>&1 &
    pids+=($!); echo $! >"$LOCAL/run/$pidname.pid"
    LAST_PID=$!
}
# gateway_command PORT: the gateway's command line on $HOST:PORT, one word a line,
# from localrun.processes.gateway_argv (fails on a PLATFORM_SERVER it
# does not know).
gateway_command() {
    $PY -c 'import sys
from localrun.processes import gateway_argv
print("\n".join(gateway_argv(int(sys.argv[1]), host=sys.argv[2], log_level="info")))' "$1" "$HOST"
}
# Names of each region's logs and pid files: server.log as before with one region,
# server-east.log and so on with two.
suffix() { if [ "$REGIONS" = 2 ]; then echo "-$1"; fi; }

for index in "${!REGION_NAMES[@]}"; do
    name=${REGION_NAMES[$index]}
    sfx=$(suffix "$name")
    if [ "$index" -gt 0 ]; then
        # The second region's pools, sized like the first's (the same demo team,
        # models and credentials).
        PLATFORM_REGION=$name REDIS_URL=$(region_redis "$index") \
            $PY manage.py bootstrap_local --json --credentials "$LOCAL/credentials.json" >/dev/null
    fi
    # The region's control loops (autoscaler, usage flush, reaper...) with beat,
    # on the region's own broker.
    run_in "$name" "$index" "worker$sfx.log" "worker$sfx" \
        .venv/bin/celery -A config worker -B -Q celery --concurrency 1 --loglevel INFO \
        -n "celery$sfx@%h" --schedule "$LOCAL/celerybeat-schedule$sfx"
    # The node agent runs the region's replicas: two simulated chat-7b and one
    # reason-70b, from the pools make up registered.
    run_in "$name" "$index" "agent$sfx.log" "agent$sfx" \
        $PY manage.py engine_agent --node "${PLATFORM_NODE:-local-1}$sfx" --region "$name" \
        --gpus "${PLATFORM_NODE_GPUS:-8}" --ports "${REPLICA_PORTS[$index]}" \
        --log-dir "$LOCAL/logs/replicas$sfx"
    AGENT_PIDS[$index]=$LAST_PID
    # The ASGI server PLATFORM_SERVER names (uvicorn unless set; daphne is the
    # other supported one), on the command line the tests and the bench use too.
    server_words=$(gateway_command "${GATEWAY_PORTS[$index]}")
    readarray -t server_argv <<<"$server_words"
    run_in "$name" "$index" "server$sfx.log" "server$sfx" "${server_argv[@]}"
    SERVER_PIDS[$index]=$LAST_PID
done

# The version gates run for minutes to hours: a worker of their own (queue gates),
# so the control loops' ticks never wait behind them. Their eval prompts go
# through the first region's gateway.
FIRST_GATEWAY=http://$HOST:${GATEWAY_PORTS[0]}
PLATFORM_GATE_GATEWAY_URL="${PLATFORM_GATE_GATEWAY_URL:-$FIRST_GATEWAY}" \
    run_in "${REGION_NAMES[0]}" 0 gates-worker.log gates-worker \
    .venv/bin/celery -A config worker -Q gates --concurrency 1 --loglevel INFO -n "gates@%h"

# Batch runners work a job for minutes at a time (queue batches): two at once,
# each sending its lines through the first region's gateway at the batch tier.
PLATFORM_BATCH_GATEWAY_URL="${PLATFORM_BATCH_GATEWAY_URL:-$FIRST_GATEWAY}" \
    run_in "${REGION_NAMES[0]}" 0 batches-worker.log batches-worker \
    .venv/bin/celery -A config worker -Q batches --concurrency 2 --loglevel INFO -n "batches@%h"

# The global load balancer, with two regions: its configuration rendered from
# them (routing.domain.global_lb), each region's /healthz checked.
if [ "$REGIONS" = 2 ]; then
    $PY manage.py render_haproxy \
        --region "${REGION_NAMES[0]}=$HOST:${GATEWAY_PORTS[0]},$HOST:$PORT" \
        --region "${REGION_NAMES[1]}=$HOST:${GATEWAY_PORTS[1]},$HOST:$((PORT + 1))" \
        --out "$LOCAL/haproxy.cfg"
    $SETSID haproxy -db -f "$LOCAL/haproxy.cfg" </dev/null >"$LOCAL/logs/haproxy.log" 2>&1 &
    pids+=($!); echo $! >"$LOCAL/run/haproxy.pid"
fi

# Poll until each region can serve: its gateway's /healthz answers 200 once its
# pools have serving replicas (instead of sleeping a fixed time).
for index in "${!REGION_NAMES[@]}"; do
    name=${REGION_NAMES[$index]}
    sfx=$(suffix "$name")
    for _ in $(seq 1 300); do
        if $PY - "http://$HOST:${GATEWAY_PORTS[$index]}/healthz" <<'PYEOF' 2>/dev/null; then break; fi
import sys, httpx
sys.exit(0 if httpx.get(sys.argv[1], timeout=1).status_code == 200 else 1)
PYEOF
        if ! kill -0 "${SERVER_PIDS[$index]}" 2>/dev/null; then
            echo "the server of region $name failed to start; see $LOCAL/logs/server$sfx.log" >&2
            tail -n 20 "$LOCAL/logs/server$sfx.log" >&2
            exit 1
        fi
        if ! kill -0 "${AGENT_PIDS[$index]}" 2>/dev/null; then
            echo "the node agent of region $name failed; see $LOCAL/logs/agent$sfx.log" >&2
            tail -n 20 "$LOCAL/logs/agent$sfx.log" >&2
            exit 1
        fi
        $PY -c 'import time; time.sleep(0.2)'
    done
done
REPLICAS=$($PY manage.py list_replicas --state serving | sed 's/^/                 /')
CHAT_URL=$($PY manage.py list_replicas --state serving --model chat-7b | awk 'NR==1 {print $3}')

ADMIN_TOKEN=$(field admin_token)
TEAM_KEY=$(field team_key)
METRICS_TOKEN=$PLATFORM_METRICS_TOKEN
SIM_ADMIN_TOKEN=$PLATFORM_SIM_ADMIN_TOKEN
# Wait until the gateway routes to the replicas (its snapshot refreshes every 2 s).
# The key goes in the environment: argv would show it in the process list. A
# platform that never answers says so and stops: no banner with credentials that
# do not work.
ANSWERED=""
for _ in $(seq 1 100); do
    if PROBE_KEY=$TEAM_KEY $PY - "http://$HOST:$PORT" <<'PYEOF' 2>/dev/null; then ANSWERED=1; break; fi
import os, sys, httpx
r = httpx.post(f"{sys.argv[1]}/v1/chat/completions", timeout=5,
               headers={"Authorization": f"Bearer {os.environ['PROBE_KEY']}"},
               json={"model": "chat-7b", "messages": [{"role": "user", "content": "ping"}],
                     "max_tokens": 1})
sys.exit(0 if r.status_code == 200 else 1)
PYEOF
    $PY -c 'import time; time.sleep(0.2)'
done
if [ -z "$ANSWERED" ]; then
    echo "make up: the gateway on http://$HOST:$PORT never answered a chat; see $LOCAL/logs/" >&2
    exit 1
fi
if [ "$REGIONS" = 2 ]; then
    WHERE="regions ${REGION_NAMES[0]} and ${REGION_NAMES[1]}, behind HAProxy"
    REGION_LINES="  Regions        ${REGION_NAMES[0]}: clients http://$HOST:$PORT, gateway http://$HOST:${GATEWAY_PORTS[0]}
                 ${REGION_NAMES[1]}: clients http://$HOST:$((PORT + 1)), gateway http://$HOST:${GATEWAY_PORTS[1]}
                 each client's frontend sends it home, or to the other region while home's
                 /healthz says it cannot serve; try: curl -s http://$HOST:${GATEWAY_PORTS[0]}/healthz
                 HAProxy: $LOCAL/haproxy.cfg; kill a region's server (its pid in $LOCAL/run/) and
                 its clients are served by the other, while make up goes on
"
    LOGS="$LOCAL/logs/{server,worker,agent}-{${REGION_NAMES[0]},${REGION_NAMES[1]}}.log, {gates,batches}-worker.log, haproxy.log, replicas-*/"
else
    WHERE="region ${REGION_NAMES[0]}"
    REGION_LINES=""
    LOGS="$LOCAL/logs/{server,worker,gates-worker,batches-worker,agent}.log, $LOCAL/logs/replicas/"
fi
BACKENDS=$($PY -m localrun.up_checks backends | sed 's/^/  /')
cat <<BANNER

  Serving platform is up ($WHERE).
${REGION_LINES}
$BACKENDS

  Console        http://$HOST:$PORT/console/
                 user $(field console_user), password $(field console_password)
                 finance (Reports only): user $(field finance_user), password $(field finance_password)
  Admin token    $ADMIN_TOKEN
  Team key       $TEAM_KEY   (team $(field team))
  Metrics token  $METRICS_TOKEN
                 curl -s -H "Authorization: Bearer $METRICS_TOKEN" http://$HOST:$PORT/metrics
  Replicas (simulated vLLM, through the node agent; /v1 needs the engine key):
$REPLICAS
  Engine key and the replicas' admin token: $LOCAL/credentials.json (mode 600)
  Logs           $LOGS

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
if [ "$REGIONS" = 2 ]; then
    # With two regions, losing one region's process is the drill, not the end:
    # the balancer sends its clients to the other. Say so, and go on until Ctrl-C.
    while true; do
        status=0
        wait -n "${pids[@]}" || status=$?
        echo "a platform process exited (status $status); see $LOCAL/logs/; the other region goes on serving" >&2
        alive=()
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
        [ "${#alive[@]}" -gt 0 ] || exit 1
        pids=("${alive[@]}")
    done
fi
wait -n "${pids[@]}" || status=$?
echo "a platform process exited (status $status); see $LOCAL/logs/" >&2
exit 1
