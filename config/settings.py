"""Settings for the serving platform, read from the environment.

Every variable is documented in docs/configuration.md. There is no local_settings.py:
one process configuration is one environment.
"""

from __future__ import annotations

import logging
import os
import secrets
from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

# Pure modules (no Django): the platform's admission and routing defaults.
from batches.domain.guard import BatchGuard
from config.env import (
    EnvError,
    env_bool,
    env_float,
    env_float_pairs,
    env_int,
    env_list,
    env_networks,
    env_pairs,
    env_secret,
    env_str,
    parse_database_url,
)
from routing.domain.admission_control import AdmissionOptions
from routing.domain.policies import DEFAULT_POLICY_OPTIONS
from routing.domain.refusals import DEFAULT_REFUSAL_PATTERNS, parse_refusal_patterns

_ADMISSION = AdmissionOptions()
_GUARD = BatchGuard()

logger = logging.getLogger("config")

BASE_DIR = Path(__file__).resolve().parent.parent
LOCAL_DIR = BASE_DIR / ".local"

# ---------------------------------------------------------------------------
# Core
# ---------------------------------------------------------------------------
try:
    DEBUG = env_bool("PLATFORM_DEBUG", False)
    _secret_key = env_secret("SECRET_KEY")
except EnvError as exc:
    raise ImproperlyConfigured(str(exc)) from None

# Without SECRET_KEY each process draws its own random key: nothing breaks, but
# console sessions end at restart and differ between processes. `make up` writes a
# persistent key to .local/secret_key; production sets SECRET_KEY or SECRET_KEY_FILE.
SECRET_KEY_IS_EPHEMERAL = _secret_key is None
SECRET_KEY = _secret_key or secrets.token_urlsafe(50)

ALLOWED_HOSTS = env_list("PLATFORM_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("PLATFORM_CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "django_prometheus",
    "audit",
    "accounts",
    "models_registry",
    "routing",
    "metering",
    "rollouts",
    "engine_nodes",
    "batches",
    "control",
    "localrun",
    "drills",
    "console",
]

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Every answer says its request's id (the caller's X-Request-Id, or a new one).
    "config.request_ids.RequestId",
    "config.request_guards.RejectNulBytes",
    # A lost database answers 503 with Retry-After, not 500 (config.control_plane).
    "config.control_plane.DatabaseUnavailable",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"
WSGI_APPLICATION = "config.wsgi.application"
# The control plane owns /admin/ (the seed's paths); none of its URLs end in "/".
APPEND_SLASH = False

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# ---------------------------------------------------------------------------
# Database
# ---------------------------------------------------------------------------
if "PLATFORM_DB_CONN_MAX_AGE_S" in os.environ:
    # Persistent connections leaked one connection per request under ASGI.
    raise ImproperlyConfigured(
        "PLATFORM_DB_CONN_MAX_AGE_S was removed: connections come from a pool "
        "(PLATFORM_DB_POOL_MAX_SIZE, docs/configuration.md)"
    )
try:
    DATABASES = {
        "default": parse_database_url(
            env_str("DATABASE_URL", "sqlite:///.local/platform.sqlite3"),
            base_dir=BASE_DIR,
            # A silent (blackholed) PostgreSQL fails a query within this, not minutes.
            tcp_timeout_s=env_float("PLATFORM_DB_TCP_TIMEOUT_S", 10.0, minimum=1.0),
        )
    }
except EnvError as exc:
    raise ImproperlyConfigured(str(exc)) from None
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    Path(DATABASES["default"]["NAME"]).parent.mkdir(parents=True, exist_ok=True)
    # Waits for a writer instead of failing at once when the worker and the
    # server write together.
    # WAL lets the gateway's snapshot reads run beside the agent's heartbeat
    # writes; IMMEDIATE transactions wait for the lock instead of deadlocking.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
    }
    # A file, not memory, so end-to-end tests can share it with the processes
    # they start (gateway, node agent).
    DATABASES["default"]["TEST"] = {"NAME": str(LOCAL_DIR / "test-platform.sqlite3")}
else:
    # Under ASGI every request runs its sync code in a thread of its own, so a
    # persistent connection (CONN_MAX_AGE > 0) was left open by each request and
    # never reused: thirty requests left thirty connections. Each process keeps a
    # pool instead (psycopg_pool, through Django's OPTIONS["pool"]): a request takes
    # a connection and gives it back when it ends, at most
    # PLATFORM_DB_POOL_MAX_SIZE are ever open, and a request that finds them all
    # busy waits up to PLATFORM_DB_POOL_TIMEOUT_S. Pools need CONN_MAX_AGE = 0.
    # Celery's prefork worker closes the pool around every task (its Django
    # fixup), so a forked child never shares its parent's connections.
    try:
        _pool_max_size = env_int("PLATFORM_DB_POOL_MAX_SIZE", 10, minimum=0)
        _pool_min_size = env_int("PLATFORM_DB_POOL_MIN_SIZE", 1, minimum=0)
        _pool_timeout_s = env_float("PLATFORM_DB_POOL_TIMEOUT_S", 5.0, minimum=0.1)
    except EnvError as exc:
        raise ImproperlyConfigured(str(exc)) from None
    if _pool_max_size and _pool_min_size > _pool_max_size:
        raise ImproperlyConfigured(
            "PLATFORM_DB_POOL_MIN_SIZE must not exceed PLATFORM_DB_POOL_MAX_SIZE"
        )
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
    if _pool_max_size:
        DATABASES["default"]["OPTIONS"]["pool"] = {
            "min_size": _pool_min_size,
            "max_size": _pool_max_size,
            "timeout": _pool_timeout_s,
            # After an outage psycopg_pool retries with doubling delays for
            # reconnect_timeout (5 minutes by default), so a gateway could stay
            # degraded for a minute after the database is back. Giving up sooner
            # lets the next request start a fresh attempt at once.
            "reconnect_timeout": 2 * _pool_timeout_s,
        }
    # PLATFORM_DB_POOL_MAX_SIZE=0: no pool; each request opens a connection and
    # closes it when it ends (behind PgBouncer, which pools for every process).
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# ---------------------------------------------------------------------------
# Redis: broker, cache and channel layer. Optional; without it, stand-ins.
# ---------------------------------------------------------------------------
REDIS_URL = env_str("REDIS_URL", "")
REDIS_KEY_PREFIX = env_str("PLATFORM_REDIS_PREFIX", "platform")

if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": REDIS_KEY_PREFIX,
        }
    }
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL], "prefix": f"{REDIS_KEY_PREFIX}:asgi"},
        }
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# ---------------------------------------------------------------------------
# Auth, i18n, static
# ---------------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {
        "NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"
    },
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = LOCAL_DIR / "static"
# Chart.js for the console's charts, from Debian's libjs-chart.js (no CDN); where
# it is not installed the console's pages still update their tables.
_CHARTJS_DIR = Path("/usr/share/javascript/chart.js")
STATICFILES_DIRS = [("vendor/chartjs", _CHARTJS_DIR)] if _CHARTJS_DIR.is_dir() else []
LOGIN_URL = "/console/login/"
# Console login: single sign-on through an OIDC provider (console.sso, Authlib's
# client) and, for bootstrap, passwords; PLATFORM_CONSOLE_PASSWORD_LOGIN=false
# leaves only single sign-on (docs/platform-admins.md#single-sign-on).
try:
    PLATFORM_CONSOLE_PASSWORD_LOGIN = env_bool("PLATFORM_CONSOLE_PASSWORD_LOGIN", True)
    PLATFORM_OIDC_DISCOVERY_URL = env_str("PLATFORM_OIDC_DISCOVERY_URL", "")
    PLATFORM_OIDC_CLIENT_ID = env_str("PLATFORM_OIDC_CLIENT_ID", "")
    PLATFORM_OIDC_CLIENT_SECRET = env_secret("PLATFORM_OIDC_CLIENT_SECRET") or ""
    PLATFORM_OIDC_SCOPES = env_list(
        "PLATFORM_OIDC_SCOPES", ["openid", "email", "profile"]
    )
    PLATFORM_OIDC_GROUPS_CLAIM = env_str("PLATFORM_OIDC_GROUPS_CLAIM", "groups")
    PLATFORM_OIDC_ADMIN_GROUPS = env_list(
        "PLATFORM_OIDC_ADMIN_GROUPS", ["platform-admins"]
    )
    PLATFORM_OIDC_FINANCE_GROUPS = env_list("PLATFORM_OIDC_FINANCE_GROUPS", ["finance"])
    PLATFORM_OIDC_TEAM_VIEWER_PREFIX = env_str(
        "PLATFORM_OIDC_TEAM_VIEWER_PREFIX", "team-viewer:"
    )
    PLATFORM_OIDC_TIMEOUT_S = env_float("PLATFORM_OIDC_TIMEOUT_S", 10.0, minimum=0.1)
    PLATFORM_OIDC_LEEWAY_S = env_int("PLATFORM_OIDC_LEEWAY_S", 60, minimum=0)
except EnvError as exc:
    raise ImproperlyConfigured(str(exc)) from None
# Django's password backend only while password login is on; the console's own
# backends answer for single sign-on and a team's viewers (console.team_viewers),
# and keep the groups' permissions working without the password backend.
AUTHENTICATION_BACKENDS = [
    "console.sso.SsoBackend",
    "console.team_viewers.TeamViewerBackend",
    *(
        ["django.contrib.auth.backends.ModelBackend"]
        if PLATFORM_CONSOLE_PASSWORD_LOGIN
        else []
    ),
]
# Console sessions are read on every console page, so keep them in signed cookies
# only if asked; the database backend is the safe default.
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = env_bool("PLATFORM_SECURE_COOKIES", False)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
MESSAGE_STORAGE = "django.contrib.messages.storage.session.SessionStorage"

# ---------------------------------------------------------------------------
# REST framework (control plane at /admin/)
# ---------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["accounts.auth.AdminTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["accounts.auth.IsPlatformAdmin"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    # JSONParser within bounds (nesting, NUL, surrogates): config/parsers.py.
    "DEFAULT_PARSER_CLASSES": ["config.parsers.BodyParser"],
    "EXCEPTION_HANDLER": "config.errors.api_exception_handler",
    # Path rules and every operation's errors documented: config/api.py.
    "DEFAULT_SCHEMA_CLASS": "config.api.ControlPlaneSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Serving platform control plane",
    "DESCRIPTION": (
        "Models, versions, rollouts, aliases, teams, limits and pools. A body is one "
        "JSON object of at most 2.5 MB, nested at most 64 levels deep, with finite "
        "numbers, integers of at most 64 digits and no lone surrogates. Every error "
        'has one shape: {"error": {"type", "message", "param", "code"}}.'
    ),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SCHEMA_PATH_PREFIX": "/admin",
    # 3.1 (JSON Schema 2020-12): propertyNames and numeric exclusive bounds say
    # what an engine config's keys and a canary's percent must be.
    "OAS_VERSION": "3.1.0",
    # The schema is part of the control plane: same token, same refusal of team keys.
    "SERVE_AUTHENTICATION": ["accounts.auth.AdminTokenAuthentication"],
    "SERVE_PERMISSIONS": ["accounts.auth.IsPlatformAdmin"],
    "PREPROCESSING_HOOKS": ["config.api.keep_admin_paths"],
    # A decision's reason and a pool's last reason are one choice set: one name.
    "ENUM_NAME_OVERRIDES": {
        "ScalingReasonEnum": "control.api.serializers.REASONS",
    },
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "config.api.finish_schema",
    ],
}

# ---------------------------------------------------------------------------
# Platform
# ---------------------------------------------------------------------------
try:
    PLATFORM_REGION = env_str("PLATFORM_REGION", "local")
    PLATFORM_GPU_HOUR_USD = env_float("PLATFORM_GPU_HOUR_USD", 2.50, minimum=0.0)
    # Output tokens per second one replica is assumed to make until a load test
    # measures its version (seed: 2,500); the cost model's capacity.
    PLATFORM_ASSUMED_TOKENS_PER_S = env_float(
        "PLATFORM_ASSUMED_TOKENS_PER_S", 2500.0, minimum=1.0
    )
    # A region's own GPU-hour price ("east=2.50,west=3.10"); others pay the default.
    PLATFORM_GPU_HOUR_USD_BY_REGION = env_float_pairs(
        "PLATFORM_GPU_HOUR_USD_BY_REGION", minimum=0.0
    )
    # What a token weighs in the teams' split of a pool's cost, in output tokens
    # (metering.domain.cost.TokenWeights): "prompt=0.25,cached=0.025,output=1".
    PLATFORM_COST_WEIGHTS = env_float_pairs("PLATFORM_COST_WEIGHTS", minimum=0.0)
    _unknown_weights = set(PLATFORM_COST_WEIGHTS) - {"prompt", "cached", "output"}
    if _unknown_weights:
        raise EnvError(
            f"PLATFORM_COST_WEIGHTS knows prompt, cached and output, not "
            f"{', '.join(sorted(_unknown_weights))}"
        )
    # Replicas beat every PLATFORM_HEARTBEAT_S; after PLATFORM_MISSED_BEATS missed
    # beats a replica leaves the ring and the reaper marks it gone.
    PLATFORM_HEARTBEAT_S = env_float("PLATFORM_HEARTBEAT_S", 1.0, minimum=0.05)
    PLATFORM_MISSED_BEATS = env_int("PLATFORM_MISSED_BEATS", 3, minimum=1)
    # Beats reach Redis every PLATFORM_HEARTBEAT_S (routers act on those); the
    # database gets them every PLATFORM_HEARTBEAT_DB_S, and the reaper and the pool
    # state judge silence against that slower clock.
    PLATFORM_HEARTBEAT_DB_S = env_float(
        "PLATFORM_HEARTBEAT_DB_S", PLATFORM_HEARTBEAT_S, minimum=0.05
    )
    PLATFORM_REAPER_INTERVAL_S = env_float(
        "PLATFORM_REAPER_INTERVAL_S", 5.0, minimum=0.5
    )
    # A serving replica holding requests whose engine shows no progress (generated
    # tokens, requests, KV usage all flat) for this long is marked stalled: routers
    # skip it until it moves again.
    PLATFORM_STALL_AFTER_S = env_float("PLATFORM_STALL_AFTER_S", 10.0, minimum=0.5)
    # A draining replica (scale-down) stops once idle; past this deadline it stops
    # anyway, and the gateway ends its open streams with the explicit error event.
    PLATFORM_DRAIN_TIMEOUT_S = env_float("PLATFORM_DRAIN_TIMEOUT_S", 600.0, minimum=1.0)
    # Weights, eval reports and batch files may live only under these URI prefixes.
    PLATFORM_STORAGE_ROOTS = env_list(
        "PLATFORM_STORAGE_ROOTS",
        [
            "s3://models/",
            "gs://models/",
            f"file://{BASE_DIR / '.local' / 'weights'}/",
            # The eval sets this checkout ships, and where local gate reports go.
            f"file://{BASE_DIR / 'platform' / 'evals'}/",
            f"file://{BASE_DIR / '.local' / 'reports'}/",
            f"file://{BASE_DIR / '.local' / 'batches'}/",
        ],
    )
    # The gateway (/v1). Default deny: a team uses only the models it has a limits
    # row on (403 model_not_allowed otherwise). An operator may set a positive
    # default to let every team call every model at that rate without a grant.
    PLATFORM_DEFAULT_TOKENS_PER_MINUTE = env_int(
        "PLATFORM_DEFAULT_TOKENS_PER_MINUTE", 0, minimum=0
    )
    # The tiers (x-priority) a team may use on a model it has no entitlement row
    # on (PUT /admin/teams/{team}/entitlements): all three unless narrowed here.
    PLATFORM_DEFAULT_TIERS = env_list(
        "PLATFORM_DEFAULT_TIERS", ["interactive", "standard", "batch"]
    )
    _unknown_tiers = set(PLATFORM_DEFAULT_TIERS) - {"interactive", "standard", "batch"}
    if _unknown_tiers:
        raise EnvError(
            "PLATFORM_DEFAULT_TIERS knows interactive, standard and batch, not "
            f"{', '.join(sorted(_unknown_tiers))}"
        )
    # A team's USD budget alerts at this fraction of it unless the budget sets
    # its own (soft), and refuses new requests past this one (hard).
    PLATFORM_BUDGET_SOFT_FRACTION = env_float(
        "PLATFORM_BUDGET_SOFT_FRACTION", 0.8, minimum=0.0
    )
    PLATFORM_BUDGET_HARD_FRACTION = env_float(
        "PLATFORM_BUDGET_HARD_FRACTION", 1.0, minimum=0.0
    )
    PLATFORM_DEFAULT_MAX_CONCURRENCY = env_int(
        "PLATFORM_DEFAULT_MAX_CONCURRENCY", 64, minimum=0
    )
    PLATFORM_DEFAULT_MAX_TOKENS = env_int(
        "PLATFORM_DEFAULT_MAX_TOKENS", 1024, minimum=1
    )
    PLATFORM_MAX_BODY_BYTES = env_int(
        "PLATFORM_MAX_BODY_BYTES", 4 * 1024 * 1024, minimum=1024
    )
    PLATFORM_ROUTING_POLICY = env_str("PLATFORM_ROUTING_POLICY", "prefix_affinity")
    # Admission (per pool): capacity = serving replicas x the version's load-tested
    # tokens in flight, or this default per replica until a load test has run.
    PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT = env_int(
        "PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT", 110_000, minimum=1
    )
    # The autoscaler sizes an embedding pool on input tokens/s: a replica's
    # measured rate at its latency target, or this default until it is measured.
    PLATFORM_DEFAULT_EMBEDDING_REPLICA_TOKENS_PER_S = env_float(
        "PLATFORM_DEFAULT_EMBEDDING_REPLICA_TOKENS_PER_S", 40_000.0, minimum=1.0
    )
    # The defaults of admission and routing are the domain's own (one set, shared
    # with the fleet simulator): AdmissionOptions and PolicyOptions.
    PLATFORM_ADMISSION_MAX_QUEUE = env_int(
        "PLATFORM_ADMISSION_MAX_QUEUE", _ADMISSION.max_queue, minimum=1
    )
    PLATFORM_ADMISSION_MAX_WAIT_S = env_float(
        "PLATFORM_ADMISSION_MAX_WAIT_S", _ADMISSION.max_wait_s, minimum=0.1
    )
    # Batch runs only on idle capacity: below this fraction of the pool's capacity.
    PLATFORM_BATCH_CEILING = env_float(
        "PLATFORM_BATCH_CEILING", _ADMISSION.batch_ceiling, minimum=0.0
    )
    # And the batch tier's own tokens in flight stay below this fraction of the
    # pool's capacity (the batch lane: for engines without per-priority ceilings).
    PLATFORM_BATCH_LANE = env_float(
        "PLATFORM_BATCH_LANE", _ADMISSION.batch_lane, minimum=0.0
    )
    # Below this many tokens in flight no replica counts as overloaded, so light
    # traffic keeps its prefix affinity (about 15% of a 7B replica's capacity).
    PLATFORM_AFFINITY_MIN_BOUND_TOKENS = env_int(
        "PLATFORM_AFFINITY_MIN_BOUND_TOKENS",
        DEFAULT_POLICY_OPTIONS.min_bound_tokens,
        minimum=0,
    )
    # Prefix affinity tries this many replicas in ring order before the least
    # loaded (0: the whole ring); 1 measured best (docs/fleet-simulator.md).
    PLATFORM_AFFINITY_RING_CHOICES = env_int(
        "PLATFORM_AFFINITY_RING_CHOICES",
        DEFAULT_POLICY_OPTIONS.ring_choices,
        minimum=0,
    )
    # Cache-aware routing (PLATFORM_ROUTING_POLICY=cache_aware): how many more
    # prompt tokens a warm replica may owe in prefill than the fastest before a
    # request leaves its cache, and its ceiling over the pool's average tokens in
    # flight (routing.domain.policies.PolicyOptions).
    PLATFORM_CACHE_PREFILL_GAP_TOKENS = env_int(
        "PLATFORM_CACHE_PREFILL_GAP_TOKENS",
        DEFAULT_POLICY_OPTIONS.prefill_gap_tokens,
        minimum=0,
    )
    PLATFORM_CACHE_LOAD_FACTOR = env_float(
        "PLATFORM_CACHE_LOAD_FACTOR",
        DEFAULT_POLICY_OPTIONS.cache_load_factor,
        minimum=1.0,
    )
    PLATFORM_RETRY_RATIO = env_float("PLATFORM_RETRY_RATIO", 0.1, minimum=0.0)
    PLATFORM_SNAPSHOT_REFRESH_S = env_float(
        "PLATFORM_SNAPSHOT_REFRESH_S", 2.0, minimum=0.1
    )
    # The last snapshot on local disk, for a gateway restarted while the database
    # is down (routing.snapshots); empty disables it.
    # (env_str reads empty as unset: here empty means off.)
    _snapshot_path = os.environ.get("PLATFORM_SNAPSHOT_PATH")
    PLATFORM_SNAPSHOT_PATH = (
        str(LOCAL_DIR / "snapshots" / f"{PLATFORM_REGION}.json")
        if _snapshot_path is None
        else _snapshot_path.strip()
    )
    PLATFORM_SNAPSHOT_PERSIST_S = env_float(
        "PLATFORM_SNAPSHOT_PERSIST_S", 10.0, minimum=0.0
    )
    # A snapshot file older than this is not served (keys revoked since still
    # open it): a gateway restarted after a day-long outage waits for the database.
    PLATFORM_SNAPSHOT_MAX_FILE_AGE_S = env_float(
        "PLATFORM_SNAPSHOT_MAX_FILE_AGE_S", 86_400.0, minimum=1.0
    )
    PLATFORM_UPSTREAM_CONNECT_TIMEOUT_S = env_float(
        "PLATFORM_UPSTREAM_CONNECT_TIMEOUT_S", 2.0, minimum=0.05
    )
    # A replica silent past these is failed: before the first token the request is
    # retried on another (the client sees nothing), after it the stream ends with
    # the error event (docs/configuration.md). A replica holding requests and silent
    # to all for PLATFORM_GATEWAY_STALL_S is stalled: its waiting ones move at once.
    _FT, _IT = "PLATFORM_FIRST_TOKEN_TIMEOUT_S", "PLATFORM_INTER_TOKEN_TIMEOUT_S"
    PLATFORM_FIRST_TOKEN_TIMEOUT_S = env_float(_FT, 30.0, minimum=0.1)
    PLATFORM_INTER_TOKEN_TIMEOUT_S = env_float(_IT, 15.0, minimum=0.1)
    PLATFORM_GATEWAY_STALL_S = env_float("PLATFORM_GATEWAY_STALL_S", 5.0, minimum=0.1)
    # The key engines (vLLM's --api-key, passed as VLLM_API_KEY) demand on /v1: the
    # node agent starts replicas with it and the gateway sends it upstream.
    PLATFORM_ENGINE_API_KEY = env_secret("PLATFORM_ENGINE_API_KEY") or ""
    # The bearer token simulated replicas demand on /sim/faults and /sim/state
    # (the node agent passes it as SIM_ADMIN_TOKEN, out of the process list).
    PLATFORM_SIM_ADMIN_TOKEN = env_secret("PLATFORM_SIM_ADMIN_TOKEN") or ""
    # OpenTelemetry traces of the gateway (routing/traces.py, docs/monitoring.md):
    # off by default. The endpoint is OTLP/HTTP's traces URL; empty falls back to
    # the SDK's own OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT.
    # The ratio samples new traces (ParentBased(TraceIdRatioBased)): 1% keeps
    # the CPU per relayed token within 1% of tracing off (bench/gateway.py).
    PLATFORM_TRACES_ENABLED = env_bool("PLATFORM_TRACES_ENABLED", False)
    PLATFORM_TRACES_ENDPOINT = env_str("PLATFORM_TRACES_ENDPOINT", "")
    PLATFORM_TRACES_SAMPLE_RATIO = env_float(
        "PLATFORM_TRACES_SAMPLE_RATIO", 0.01, minimum=0.0
    )
    if PLATFORM_TRACES_SAMPLE_RATIO > 1.0:
        raise EnvError("PLATFORM_TRACES_SAMPLE_RATIO must be at most 1")
    # Where the node agent's replicas send their own spans (vLLM's and the
    # simulator's --otlp-traces-endpoint); empty: engines export none.
    PLATFORM_TRACES_ENGINE_ENDPOINT = env_str(
        "PLATFORM_TRACES_ENGINE_ENDPOINT",
        PLATFORM_TRACES_ENDPOINT if PLATFORM_TRACES_ENABLED else "",
    )
    # The bearer token a scraper sends for /metrics; unset, /metrics answers 403.
    PLATFORM_METRICS_TOKEN = env_secret("PLATFORM_METRICS_TOKEN") or ""
    # The Retry-After of the control plane's 503 while its database is down.
    PLATFORM_CONTROL_PLANE_RETRY_AFTER_S = env_float(
        "PLATFORM_CONTROL_PLANE_RETRY_AFTER_S", 5.0, minimum=1.0
    )
    # How often each gateway process writes the keys it saw to last_used_at.
    PLATFORM_KEY_LAST_USED_FLUSH_S = env_float(
        "PLATFORM_KEY_LAST_USED_FLUSH_S", 60.0, minimum=0.1
    )
    # Console login: failures per user name and address, per address, and the
    # lockout (also the window failures are counted over).
    PLATFORM_CONSOLE_LOGIN_MAX_FAILURES = env_int(
        "PLATFORM_CONSOLE_LOGIN_MAX_FAILURES", 5, minimum=1
    )
    PLATFORM_CONSOLE_LOGIN_MAX_FAILURES_PER_IP = env_int(
        "PLATFORM_CONSOLE_LOGIN_MAX_FAILURES_PER_IP", 20, minimum=1
    )
    PLATFORM_CONSOLE_LOGIN_LOCKOUT_S = env_float(
        "PLATFORM_CONSOLE_LOGIN_LOCKOUT_S", 900.0, minimum=1.0
    )
    # The proxies (CIDRs) whose X-Forwarded-For the audit trail believes, to
    # record the client's address rather than the proxy's (audit.services).
    PLATFORM_TRUSTED_PROXIES = env_networks("PLATFORM_TRUSTED_PROXIES", [])
    # Served with the ASGI app itself (the console's CSS/JS) when no web server
    # sits in front; `make up` turns it on.
    PLATFORM_SERVE_STATIC = env_bool("PLATFORM_SERVE_STATIC", DEBUG)
    # How often usage counted in Redis reaches the database (and how often an
    # embedded gateway flushes its own ledger).
    PLATFORM_USAGE_FLUSH_S = env_float("PLATFORM_USAGE_FLUSH_S", 15.0, minimum=1.0)
    # The traffic twin (routing.traffic): pools opt in with
    # Pool.record_traffic_share. Records go to a Redis stream per model, written
    # in batches every PLATFORM_TRAFFIC_FLUSH_S, at most
    # PLATFORM_TRAFFIC_BUFFER records waiting per process (more are dropped), kept
    # PLATFORM_TRAFFIC_RECORD_RETENTION_S and at most PLATFORM_TRAFFIC_RECORD_MAX
    # per model. Prompts are kept as chains of block hashes (blocks of
    # PLATFORM_TRAFFIC_BLOCK_TOKENS tokens) keyed by PLATFORM_TRAFFIC_SALT
    # (default: derived from SECRET_KEY; every gateway must share it).
    PLATFORM_TRAFFIC_SALT = env_str("PLATFORM_TRAFFIC_SALT", "")
    PLATFORM_TRAFFIC_BLOCK_TOKENS = env_int(
        "PLATFORM_TRAFFIC_BLOCK_TOKENS", 16, minimum=1
    )
    PLATFORM_TRAFFIC_RECORD_RETENTION_S = env_float(
        "PLATFORM_TRAFFIC_RECORD_RETENTION_S", 7 * 86400.0, minimum=60.0
    )
    PLATFORM_TRAFFIC_RECORD_MAX = env_int(
        "PLATFORM_TRAFFIC_RECORD_MAX", 1_000_000, minimum=1
    )
    PLATFORM_TRAFFIC_FLUSH_S = env_float("PLATFORM_TRAFFIC_FLUSH_S", 1.0, minimum=0.05)
    PLATFORM_TRAFFIC_BUFFER = env_int("PLATFORM_TRAFFIC_BUFFER", 10_000, minimum=1)
    # The rollout guards' figures (metering.figures): the length of one bucket,
    # shared by the gateways and the flusher; and the refusal detector's patterns
    # (routing.domain.refusals), a JSON list of regular expressions.
    PLATFORM_FIGURES_BUCKET_S = env_int("PLATFORM_FIGURES_BUCKET_S", 60, minimum=1)
    try:
        PLATFORM_REFUSAL_PATTERNS = (
            parse_refusal_patterns(_patterns)
            if (_patterns := env_str("PLATFORM_REFUSAL_PATTERNS", ""))
            else DEFAULT_REFUSAL_PATTERNS
        )
    except ValueError as exc:
        raise EnvError(f"PLATFORM_REFUSAL_PATTERNS {exc}") from None
    # The autoscaler's tick (control.autoscaling), and how many of its
    # decision rows are kept per pool (older ones are pruned as new ones come).
    PLATFORM_AUTOSCALE_INTERVAL_S = env_float(
        "PLATFORM_AUTOSCALE_INTERVAL_S", 5.0, minimum=0.5
    )
    PLATFORM_AUTOSCALE_DECISIONS_KEPT = env_int(
        "PLATFORM_AUTOSCALE_DECISIONS_KEPT", 1000, minimum=1
    )
    # One limit across regions (control.region_limits): how often each region
    # publishes its teams' demand and recomputes its shares, over what window of
    # demand (in slots of PLATFORM_LIMIT_SHARES_SLOT_S), each live region's floor,
    # and after how long without figures a region counts as lost.
    PLATFORM_LIMIT_SHARES_INTERVAL_S = env_float(
        "PLATFORM_LIMIT_SHARES_INTERVAL_S", 2.0, minimum=0.5
    )
    PLATFORM_LIMIT_SHARES_WINDOW_S = env_float(
        "PLATFORM_LIMIT_SHARES_WINDOW_S", 30.0, minimum=1.0
    )
    PLATFORM_LIMIT_SHARES_SLOT_S = env_float(
        "PLATFORM_LIMIT_SHARES_SLOT_S", 5.0, minimum=0.5
    )
    PLATFORM_LIMIT_SHARES_FLOOR = env_float(
        "PLATFORM_LIMIT_SHARES_FLOOR", 0.04, minimum=0.0
    )
    if PLATFORM_LIMIT_SHARES_FLOOR > 1.0:
        raise EnvError("PLATFORM_LIMIT_SHARES_FLOOR must be at most 1")
    PLATFORM_LIMIT_SHARES_STALE_S = env_float(
        "PLATFORM_LIMIT_SHARES_STALE_S", 6.0, minimum=1.0
    )
    # The rollout guards (control.rollout_guard): how often they compare
    # each rollout's candidate with the live version and act, and how long a
    # rollout waits for its candidate's replicas to serve before it is aborted.
    PLATFORM_ROLLOUT_GUARD_INTERVAL_S = env_float(
        "PLATFORM_ROLLOUT_GUARD_INTERVAL_S", 60.0, minimum=0.5
    )
    PLATFORM_ROLLOUT_CAPACITY_TIMEOUT_S = env_float(
        "PLATFORM_ROLLOUT_CAPACITY_TIMEOUT_S", 1800.0, minimum=1.0
    )
    # The version gates (control.gates). Each region's object-storage root
    # for weights, "region=root" pairs (a version's weights are copied to each and
    # verified); unset, this region serves from the registered URI, verified in
    # place. The gates run in PLATFORM_GATE_REGION and send their eval prompts
    # through that region's gateway.
    PLATFORM_REGION_STORAGE = env_pairs("PLATFORM_REGION_STORAGE")
    PLATFORM_GATE_REGION = env_str("PLATFORM_GATE_REGION", PLATFORM_REGION)
    PLATFORM_GATE_GATEWAY_URL = env_str(
        "PLATFORM_GATE_GATEWAY_URL", "http://127.0.0.1:8000"
    )
    PLATFORM_DEFAULT_EVAL_SET = env_str(
        "PLATFORM_DEFAULT_EVAL_SET",
        f"file://{BASE_DIR / 'platform' / 'evals' / 'chat-default.jsonl'}",
    )
    PLATFORM_DEFAULT_EMBEDDING_EVAL_SET = env_str(
        "PLATFORM_DEFAULT_EMBEDDING_EVAL_SET",
        f"file://{BASE_DIR / 'platform' / 'evals' / 'embedding-default.jsonl'}",
    )
    PLATFORM_EVAL_REPORT_ROOT = env_str(
        "PLATFORM_EVAL_REPORT_ROOT", f"file://{BASE_DIR / '.local' / 'reports'}"
    )
    # How many of the judge's verdicts each eval set of a gate run keeps for
    # reviewers to label in the console (models_registry.judge_labels).
    PLATFORM_JUDGE_LABEL_SAMPLE = env_int("PLATFORM_JUDGE_LABEL_SAMPLE", 20, minimum=0)
    PLATFORM_LOAD_TEST_TRACE = env_str(
        "PLATFORM_LOAD_TEST_TRACE",
        str(BASE_DIR / "platform" / "traces" / "chat-650-250.jsonl"),
    )
    # How long the gates wait for their staging replica to serve (a 70B cold
    # start takes minutes), and for the whole of one attempt.
    PLATFORM_GATE_REPLICA_TIMEOUT_S = env_float(
        "PLATFORM_GATE_REPLICA_TIMEOUT_S", 1200.0, minimum=1.0
    )
    # The gates' own team (platform-gates) gets these limits on the models it
    # calls where an admin set none; it calls at the batch tier.
    PLATFORM_GATE_TOKENS_PER_MINUTE = env_int(
        "PLATFORM_GATE_TOKENS_PER_MINUTE", 5_000_000, minimum=1
    )
    PLATFORM_GATE_MAX_CONCURRENCY = env_int(
        "PLATFORM_GATE_MAX_CONCURRENCY", 32, minimum=1
    )
    PLATFORM_GATE_TIME_LIMIT_S = env_float(
        "PLATFORM_GATE_TIME_LIMIT_S", 4 * 3600.0, minimum=60.0
    )
    # Batches (batches.runner). Uploaded files and outputs are stored under
    # PLATFORM_BATCH_STORAGE_URI (inside a storage root); a batch's lines go to the
    # region's gateway at PLATFORM_BATCH_GATEWAY_URL with a key minted for the job.
    PLATFORM_BATCH_STORAGE_URI = env_str(
        "PLATFORM_BATCH_STORAGE_URI", f"file://{BASE_DIR / '.local' / 'batches'}/"
    )
    PLATFORM_BATCH_FILE_MAX_BYTES = env_int(
        "PLATFORM_BATCH_FILE_MAX_BYTES", 100 * 1024 * 1024, minimum=1
    )
    PLATFORM_BATCH_GATEWAY_URL = env_str(
        "PLATFORM_BATCH_GATEWAY_URL", PLATFORM_GATE_GATEWAY_URL
    )
    # How often beat hands active batches to a runner, how long a runner's claim
    # on a job holds without renewal (a killed runner's lines run again after
    # it), and how long one runner task works before handing the job on.
    PLATFORM_BATCH_DISPATCH_S = env_float("PLATFORM_BATCH_DISPATCH_S", 2.0, minimum=0.2)
    PLATFORM_BATCH_LEASE_S = env_float("PLATFORM_BATCH_LEASE_S", 30.0, minimum=1.0)
    PLATFORM_BATCH_SLICE_S = env_float("PLATFORM_BATCH_SLICE_S", 120.0, minimum=1.0)
    PLATFORM_BATCH_REQUEST_TIMEOUT_S = env_float(
        "PLATFORM_BATCH_REQUEST_TIMEOUT_S", 600.0, minimum=1.0
    )
    # A line whose answer is a 5xx other than a shed, or no answer at all, is
    # tried this many times before it is failed.
    PLATFORM_BATCH_MAX_ATTEMPTS = env_int("PLATFORM_BATCH_MAX_ATTEMPTS", 3, minimum=1)
    # The scheduler's policy (batches.domain.scheduler.SchedulerSettings).
    PLATFORM_BATCH_INITIAL_WINDOW = env_int(
        "PLATFORM_BATCH_INITIAL_WINDOW", 4, minimum=1
    )
    PLATFORM_BATCH_MAX_WINDOW = env_int("PLATFORM_BATCH_MAX_WINDOW", 64, minimum=1)
    PLATFORM_BATCH_MIN_OBSERVED_S = env_float(
        "PLATFORM_BATCH_MIN_OBSERVED_S", 30.0, minimum=0.1
    )
    PLATFORM_BATCH_RATE_WINDOW_S = env_float(
        "PLATFORM_BATCH_RATE_WINDOW_S", 60.0, minimum=0.1
    )
    # The batch guard (batches.domain.guard.BatchGuard): batch's ceilings on a
    # replica's KV and on prefill tokens per engine step (the simulated engine and
    # the fleet simulator), and the forecast back-off of the runner's windows.
    PLATFORM_BATCH_GUARD_KV_SHARE = env_float(
        "PLATFORM_BATCH_GUARD_KV_SHARE", _GUARD.kv_share, minimum=0.0
    )
    PLATFORM_BATCH_GUARD_PREFILL_TOKENS = env_int(
        "PLATFORM_BATCH_GUARD_PREFILL_TOKENS", _GUARD.prefill_tokens, minimum=1
    )
    PLATFORM_BATCH_GUARD_PREFILL_BESIDE_INTERACTIVE = env_int(
        "PLATFORM_BATCH_GUARD_PREFILL_BESIDE_INTERACTIVE",
        _GUARD.prefill_beside_interactive,
        minimum=0,
    )
    PLATFORM_BATCH_GUARD_HORIZON_S = env_float(
        "PLATFORM_BATCH_GUARD_HORIZON_S", _GUARD.horizon_s, minimum=1.0
    )
    PLATFORM_BATCH_GUARD_BACKOFF_FROM = env_float(
        "PLATFORM_BATCH_GUARD_BACKOFF_FROM", _GUARD.backoff_from, minimum=0.0
    )
    PLATFORM_BATCH_GUARD_BACKOFF_TO = env_float(
        "PLATFORM_BATCH_GUARD_BACKOFF_TO", _GUARD.backoff_to, minimum=0.0
    )
    PLATFORM_BATCH_GUARD_RAISED_SHARE = env_float(
        "PLATFORM_BATCH_GUARD_RAISED_SHARE", _GUARD.raised_share, minimum=0.0
    )
except EnvError as exc:
    raise ImproperlyConfigured(str(exc)) from None

# ---------------------------------------------------------------------------
# Celery (worker + beat). JSON only; beat schedule lives here.
# ---------------------------------------------------------------------------
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, str | bool | float] = {
        "global_keyprefix": f"{REDIS_KEY_PREFIX}:celery:",
        # An unacknowledged task goes back to the queue after this long (acks_late):
        # past the gates' time limit, so a gate attempt still running is never
        # handed to a second worker (Redis's default is an hour).
        "visibility_timeout": PLATFORM_GATE_TIME_LIMIT_S + 600,
    }
else:
    # A broker that needs no server: kombu's filesystem transport, shared by the
    # worker and the processes that enqueue on this machine. Every folder is named:
    # kombu's defaults are relative to the working directory (its exchange tables
    # went to ./control/), and it creates none of them but the last level of
    # `control_folder`.
    _broker_dir = LOCAL_DIR / "broker"
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "processed_folder": str(_broker_dir / "processed"),
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
    }
    for _folder in ("queue", "processed", "control"):
        (_broker_dir / _folder).mkdir(parents=True, exist_ok=True)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_TASK_TIME_LIMIT = 300
CELERY_TASK_SOFT_TIME_LIMIT = 240
CELERY_RESULT_EXPIRES = 3600
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TIMEZONE = "UTC"
# The version gates take minutes to hours: on a queue of their own, so the control
# loops' ticks (autoscaler, reaper, usage flush) never wait behind them.
# A batch's runner works for minutes at a time: on a queue of its own too.
CELERY_TASK_ROUTES = {
    "control.run_gates": {"queue": "gates"},
    "control.run_batch": {"queue": "batches"},
    # Their names before the control loops moved to control/ (control.tasks.RENAMED).
    "engine_nodes.run_gates": {"queue": "gates"},
    "batches.run_batch": {"queue": "batches"},
}
CELERY_BEAT_SCHEDULE_FILENAME = str(LOCAL_DIR / "celerybeat-schedule")


def _every(task: str, interval_s: float) -> dict[str, object]:
    """Beat ``task`` every ``interval_s``. A run that could not start within its
    interval expires: the next one observes anew (a stale tick would act on old
    state, and a backlog of them would run back to back)."""
    return {
        "task": task,
        "schedule": timedelta(seconds=interval_s),
        "options": {"expires": interval_s * 0.9},
    }


CELERY_BEAT_SCHEDULE = {
    "reap-silent-replicas": _every(
        "control.reap_silent_replicas", PLATFORM_REAPER_INTERVAL_S
    ),
    "flush-usage": _every("metering.flush_usage", PLATFORM_USAGE_FLUSH_S),
    "autoscale-pools": _every("control.autoscale_pools", PLATFORM_AUTOSCALE_INTERVAL_S),
    "share-region-limits": _every(
        "control.share_region_limits", PLATFORM_LIMIT_SHARES_INTERVAL_S
    ),
    "guard-rollouts": _every(
        "control.guard_rollouts", PLATFORM_ROLLOUT_GUARD_INTERVAL_S
    ),
    "dispatch-batches": _every("control.dispatch_batches", PLATFORM_BATCH_DISPATCH_S),
}

# ---------------------------------------------------------------------------
# Logging: no secrets and no prompt text, ever.
# ---------------------------------------------------------------------------
LOG_LEVEL = env_str("PLATFORM_LOG_LEVEL", "INFO").upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
