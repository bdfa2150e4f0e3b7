"""Settings for kvrun, read from the environment (12-factor).

`make run` and `make test` (kvrun.launcher) supply SECRET_KEY, KVRUN_KEY_PEPPER,
DATABASE_URL and REDIS_URL from `.kvrun/` and the embedded services; in
production they come from the deployment's environment.
"""

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

DEBUG = env.bool("DEBUG", default=False)
SECRET_KEY = env.str("SECRET_KEY")
# HMAC pepper for API key and invite token digests; kept apart from SECRET_KEY
# so that rotating sessions does not invalidate every API key.
KVRUN_KEY_PEPPER = env.str("KVRUN_KEY_PEPPER")
# Seals secrets kvrun must read back, such as hub access tokens (kvrun/common/sealing.py);
# empty: derived from SECRET_KEY. Set it to keep them through a change of SECRET_KEY.
KVRUN_SEALING_KEY = env.str("KVRUN_SEALING_KEY", default="")

ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])
DEFAULT_EXCEPTION_REPORTER_FILTER = "kvrun.common.debug.SettingsFilter"
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
KVRUN_BASE_URL = env.str("KVRUN_BASE_URL", default="http://127.0.0.1:8000")
# Where clients reach the OpenAI-compatible gateway: shown in the dashboard's snippets and
# used by its playground. The web process serves it at /v1 beside the dashboard.
KVRUN_GATEWAY_URL = env.str("KVRUN_GATEWAY_URL", default=KVRUN_BASE_URL).rstrip("/")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "django.contrib.postgres",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "axes",
    "accounts",
    "endpoints",
    "fleet",
    "billing",
    "telemetry",
    "scaling",
    "front",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "kvrun.common.middleware.BodySizeLimitMiddleware",
    "kvrun.common.middleware.ApiNotFoundMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, so that it sees the authentication outcome of the login view.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "kvrun.urls"
ASGI_APPLICATION = "kvrun.asgi.application"
WSGI_APPLICATION = "kvrun.wsgi.application"

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
                "front.context_processors.organizations",
            ],
        },
    },
]

DATABASES = {"default": env.db("DATABASE_URL")}
# Persistent connections are not safe under ASGI (Django docs); keep the default 0.
DATABASES["default"]["CONN_MAX_AGE"] = env.int("DB_CONN_MAX_AGE", default=0)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# A PostgreSQL that does not answer fails a connection instead of hanging it: the gateway
# reads keys and routes on one thread, and serves what it knew when a read fails.
DATABASES["default"].setdefault("OPTIONS", {}).setdefault(
    "connect_timeout", env.int("DB_CONNECT_TIMEOUT_SECONDS", default=3))
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env.str("REDIS_URL")
# A Redis that hangs fails the requests that need it instead of hanging them: every client
# gives up on a connection or a reply after this long.
KVRUN_REDIS_TIMEOUT_SECONDS = env.float("KVRUN_REDIS_TIMEOUT_SECONDS", default=2.0)
REDIS_OPTIONS = {
    "socket_timeout": KVRUN_REDIS_TIMEOUT_SECONDS,
    "socket_connect_timeout": KVRUN_REDIS_TIMEOUT_SECONDS,
    "health_check_interval": 30,
}
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "kvrun",
        # 2: JSON since; entries an older kvrun pickled are never read.
        "VERSION": 2,
        "OPTIONS": {**REDIS_OPTIONS, "serializer": "kvrun.common.cache.JSONSerializer"},
    }
}

AUTH_USER_MODEL = "accounts.User"
AUTHENTICATION_BACKENDS = [
    # Axes first: it refuses a locked-out account or address before any password check.
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.Argon2PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",
]
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {
        "NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
        "OPTIONS": {"min_length": 10},
    },
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"
# Mail (confirming addresses, password resets): printed to the web process's console in
# development. The file backend writes each mail under EMAIL_FILE_PATH.
EMAIL_BACKEND = env.str("EMAIL_BACKEND", default="django.core.mail.backends.console.EmailBackend"
                        if DEBUG else "django.core.mail.backends.smtp.EmailBackend")
EMAIL_HOST = env.str("EMAIL_HOST", default="localhost")
EMAIL_PORT = env.int("EMAIL_PORT", default=25)
EMAIL_HOST_USER = env.str("EMAIL_HOST_USER", default="")
EMAIL_HOST_PASSWORD = env.str("EMAIL_HOST_PASSWORD", default="")
EMAIL_USE_TLS = env.bool("EMAIL_USE_TLS", default=False)
EMAIL_FILE_PATH = env.str("EMAIL_FILE_PATH", default="")
DEFAULT_FROM_EMAIL = env.str("DEFAULT_FROM_EMAIL", default="kvrun <noreply@localhost>")

# Reverse proxies in front of the web processes, each appending to X-Forwarded-For; every
# throttle and lockout keys on the client address this implies (kvrun.common.clients).
# 0: REMOTE_ADDR.
KVRUN_TRUSTED_PROXIES = env.int("KVRUN_TRUSTED_PROXIES", default=0)

# Failed sign-ins lock the account for the address they came from, never the account from
# everywhere: otherwise anyone could lock anyone out by guessing wrong on purpose.
AXES_FAILURE_LIMIT = env.int("AXES_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = env.float("AXES_COOLOFF_HOURS", default=0.25)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
# What Django's sign-in form passes to authenticate(); axes would look for "email" (the user
# model's USERNAME_FIELD), find nothing, and lock the address for every account instead.
AXES_USERNAME_FORM_FIELD = "username"
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "accounts.views.lockout"
AXES_CLIENT_IP_CALLABLE = "kvrun.common.clients.client_address"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = env.path("STATIC_ROOT", default=BASE_DIR / ".kvrun" / "static")
STATICFILES_DIRS = [BASE_DIR / "static"]
WHITENOISE_USE_FINDERS = DEBUG

# Request bodies above this are refused with 413 (kvrun.common.middleware).
DATA_UPLOAD_MAX_MEMORY_SIZE = env.int("KVRUN_MAX_BODY_BYTES", default=1024 * 1024)

# How long a verified API key may be served from the cache; revocation also
# deletes the entry, so this bounds staleness only for changes made elsewhere.
KVRUN_API_KEY_CACHE_SECONDS = env.int("KVRUN_API_KEY_CACHE_SECONDS", default=5)
# last_used_at is written at most this often per key, off the request path.
KVRUN_API_KEY_TOUCH_SECONDS = env.int("KVRUN_API_KEY_TOUCH_SECONDS", default=60)
KVRUN_INVITE_DAYS = env.int("KVRUN_INVITE_DAYS", default=7)
# How long the link that confirms a person's email address works.
KVRUN_EMAIL_VERIFICATION_DAYS = env.int("KVRUN_EMAIL_VERIFICATION_DAYS", default=3)

# Inference limits; a key's or an organisation's own value overrides these. 0 means no limit.
KVRUN_KEY_REQUESTS_PER_MINUTE = env.int("KVRUN_KEY_REQUESTS_PER_MINUTE", default=600)
KVRUN_KEY_TOKENS_PER_MINUTE = env.int("KVRUN_KEY_TOKENS_PER_MINUTE", default=1_000_000)
KVRUN_ORG_MAX_CONCURRENT_REQUESTS = env.int("KVRUN_ORG_MAX_CONCURRENT_REQUESTS", default=64)
# What one person's organisations may hold together, unless an operator sets an
# organisation's own quota in the admin (it then counts alone). Sign-up is self-service, so
# these bound what a stranger can take before anyone looks: room to try several models and
# to run two full 8-GPU nodes, no more.
KVRUN_ORG_MAX_ENDPOINTS = env.int("KVRUN_ORG_MAX_ENDPOINTS", default=10)
# Organisations one person may own: each has quotas of its own.
KVRUN_MAX_OWNED_ORGANIZATIONS = env.int("KVRUN_MAX_OWNED_ORGANIZATIONS", default=5)
KVRUN_ORG_MAX_GPUS = env.int("KVRUN_ORG_MAX_GPUS", default=16)
KVRUN_ORG_MAX_REPLICAS = env.int("KVRUN_ORG_MAX_REPLICAS", default=16)
# Requests with unknown keys an address may send a minute (per web process) before the
# gateway refuses it without looking its keys up.
KVRUN_GATEWAY_FAILED_AUTHENTICATIONS_PER_MINUTE = env.int(
    "KVRUN_GATEWAY_FAILED_AUTHENTICATIONS_PER_MINUTE", default=30)
# How long the gateway serves an endpoint's ready replicas from memory before asking again.
KVRUN_GATEWAY_ROUTE_CACHE_SECONDS = env.float("KVRUN_GATEWAY_ROUTE_CACHE_SECONDS", default=2.0)
# Longest wait for an engine to accept a connection; past it the next replica is tried
# (nothing was sent). Seconds pass where none is lost: a gateway starved of CPU by engines
# on its host resumes a finished connect only when it next runs.
KVRUN_GATEWAY_CONNECT_TIMEOUT_SECONDS = env.float("KVRUN_GATEWAY_CONNECT_TIMEOUT_SECONDS",
                                                  default=5.0)
# Longest wait for an engine's next byte; generation of long answers can take minutes.
KVRUN_GATEWAY_UPSTREAM_TIMEOUT_SECONDS = env.float("KVRUN_GATEWAY_UPSTREAM_TIMEOUT_SECONDS",
                                                   default=600.0)
# The most the gateway holds in memory of one engine answer that is not streamed, or of one
# event of a stream; past it the request is a 502. A whole 128k-token context of text is under
# 1 MiB of JSON, so this leaves room for several choices and logprobs, while 64 requests of an
# organisation in flight hold 1 GiB at most. Longer answers can be streamed.
KVRUN_GATEWAY_MAX_ANSWER_BYTES = env.int("KVRUN_GATEWAY_MAX_ANSWER_BYTES",
                                         default=16 * 1024 * 1024)
# A request to an endpoint scaled to zero waits for its cold start this long at most, and at
# most this many such requests wait in one web process per endpoint, per organisation and in
# all; past either the answer is a 503 or a 429 with Retry-After.
KVRUN_GATEWAY_HOLD_SECONDS = env.float("KVRUN_GATEWAY_HOLD_SECONDS", default=300.0)
KVRUN_GATEWAY_HOLD_MAX_REQUESTS = env.int("KVRUN_GATEWAY_HOLD_MAX_REQUESTS", default=256)
KVRUN_GATEWAY_HOLD_MAX_REQUESTS_PER_ORGANIZATION = env.int(
    "KVRUN_GATEWAY_HOLD_MAX_REQUESTS_PER_ORGANIZATION", default=256)
KVRUN_GATEWAY_HOLD_MAX_REQUESTS_PER_PROCESS = env.int(
    "KVRUN_GATEWAY_HOLD_MAX_REQUESTS_PER_PROCESS", default=2048)
# How often a web process asks whether the endpoints its requests wait for have changed: at
# the route cache's age by default, a small share of a cold start. Each look's Python shares
# the process with every tenant's requests, so looking more often costs them.
KVRUN_GATEWAY_HOLD_WATCH_SECONDS = env.float("KVRUN_GATEWAY_HOLD_WATCH_SECONDS",
                                             default=KVRUN_GATEWAY_ROUTE_CACHE_SECONDS)
# An Idempotency-Key is remembered this long; a repeat within it does not run again.
KVRUN_IDEMPOTENCY_HOURS = env.int("KVRUN_IDEMPOTENCY_HOURS", default=24)
# Answers kept for repeats, per organisation and window of KVRUN_IDEMPOTENCY_HOURS: they share
# Redis with the broker and the usage stream.
KVRUN_IDEMPOTENCY_KEPT_MIB_PER_ORGANIZATION = env.int(
    "KVRUN_IDEMPOTENCY_KEPT_MIB_PER_ORGANIZATION", default=64)
# ... and every organisation's together: twice this stays well under Redis's memory bound
# (1 GB embedded, 2 GB under Compose), so kept answers are not evicted.
KVRUN_IDEMPOTENCY_KEPT_MIB = env.int("KVRUN_IDEMPOTENCY_KEPT_MIB", default=256)
# What a web process holds for a request (its in-flight slot, its trace for the usage ledger)
# lasts this long unless renewed: a process killed outright frees it, and has its requests
# recorded as interrupted, this long after.
KVRUN_GATEWAY_LEASE_SECONDS = env.float("KVRUN_GATEWAY_LEASE_SECONDS", default=30.0)
# A usage write waits this long for more records to join it (gateway.sink): one pipeline then
# carries several requests even at low concurrency, and its cost stays off the next request's
# path.
KVRUN_GATEWAY_GATHER_SECONDS = env.float("KVRUN_GATEWAY_GATHER_SECONDS", default=0.005)
# A stream's trace in Redis (what is billed should its web process die) may be this many
# completion tokens behind what its client has received; a whole answer, and a stream's last
# chunk, are billed before they are sent.
KVRUN_GATEWAY_TRACE_LAG_TOKENS = env.int("KVRUN_GATEWAY_TRACE_LAG_TOKENS", default=16)
# How often beat moves usage records from the gateway's stream into PostgreSQL.
KVRUN_USAGE_INGEST_SECONDS = env.float("KVRUN_USAGE_INGEST_SECONDS", default=1.0)
# How often beat rolls usage records and replica intervals up into hourly lines: how fresh the
# month's cost so far is.
KVRUN_BILLING_ROLLUP_SECONDS = env.float("KVRUN_BILLING_ROLLUP_SECONDS", default=60.0)
# A rollup transaction (a batch of stale hours, or the GPU hours) may take this long, its
# statements together (a batch of 10,000 stale hours takes well under a second); one that runs
# longer is rolled back, and the batches halved.
KVRUN_BILLING_ROLLUP_TIMEOUT_SECONDS = env.float("KVRUN_BILLING_ROLLUP_TIMEOUT_SECONDS",
                                                 default=30.0)
# A month's invoice stays a draft this long after the month ends, so that usage still on its
# way lands in its own month; later usage is an adjustment on the next invoice.
KVRUN_INVOICE_GRACE_SECONDS = env.int("KVRUN_INVOICE_GRACE_SECONDS", default=3600)
# How often budgets are checked against the month's spend projected to the next check; with
# the engines' drain and stop grace, it bounds how far spend can pass a budget that stops
# endpoints (docs/billing.md, "Spend caps").
KVRUN_BUDGET_CHECK_SECONDS = env.int("KVRUN_BUDGET_CHECK_SECONDS", default=60)
# Stripe: empty STRIPE_SECRET_KEY keeps invoices in kvrun only. STRIPE_API_BASE points the
# client elsewhere (a local Stripe stand-in in tests).
STRIPE_SECRET_KEY = env.str("STRIPE_SECRET_KEY", default="")
STRIPE_WEBHOOK_SECRET = env.str("STRIPE_WEBHOOK_SECRET", default="")
STRIPE_API_BASE = env.str("STRIPE_API_BASE", default="")
# Stored webhook deliveries are kept this long (Stripe retries one for three days at most).
KVRUN_STRIPE_EVENT_KEPT_DAYS = env.int("KVRUN_STRIPE_EVENT_KEPT_DAYS", default=90)
# After a failed payment, the organisation's endpoints keep running this long, then stop
# until it pays.
KVRUN_PAYMENT_GRACE_SECONDS = env.int("KVRUN_PAYMENT_GRACE_SECONDS", default=3 * 86400)
# The replica phases whose GPU time is billed: every phase that holds the devices, since a GPU
# held while its engine loads is a GPU nobody else can use.
KVRUN_BILLED_PHASES = env.list("KVRUN_BILLED_PHASES",
                               default=["starting", "loading", "ready", "stopping"])

KVRUN_NODE_HEARTBEAT_SECONDS = env.int("KVRUN_NODE_HEARTBEAT_SECONDS", default=5)
# A Prometheus scraper's bearer token for kvrun's own /metrics; empty: no /metrics.
KVRUN_METRICS_TOKEN = env.str("KVRUN_METRICS_TOKEN", default="")
# How often a node agent reads each of its engines' /metrics into the database.
KVRUN_ENGINE_SCRAPE_SECONDS = env.float("KVRUN_ENGINE_SCRAPE_SECONDS", default=5.0)
KVRUN_NODE_LOST_AFTER_SECONDS = env.int("KVRUN_NODE_LOST_AFTER_SECONDS", default=30)

# Engines (a node agent's own settings are nodes.config's)
KVRUN_STATE_DIR = Path(env.str("KVRUN_STATE_DIR", default=str(BASE_DIR / ".kvrun")))
# The Hugging Face hub (or a mirror of it) that models are added from and downloaded from.
KVRUN_HUB_URL = env.str("KVRUN_HUB_URL", default="https://huggingface.co").rstrip("/")
# Hub repositories whose engines may run code from the repository (--trust-remote-code).
KVRUN_REMOTE_CODE_REPOS = env.list("KVRUN_REMOTE_CODE_REPOS", default=[])
# An uploaded LoRA adapter's files, at most; kept in the database until nodes write them out.
# Larger adapters come from the hub.
KVRUN_ADAPTER_UPLOAD_MIB = env.int("KVRUN_ADAPTER_UPLOAD_MIB", default=64)
KVRUN_RECONCILE_SECONDS = env.float("KVRUN_RECONCILE_SECONDS", default=3.0)
# How often beat runs the autoscaler (scaling.tasks), and the shortest idle time a user may
# give before an endpoint scales to zero (each wake is a cold start).
KVRUN_AUTOSCALE_SECONDS = env.float("KVRUN_AUTOSCALE_SECONDS", default=5.0)
KVRUN_SCALE_TO_ZERO_MIN_SECONDS = env.int("KVRUN_SCALE_TO_ZERO_MIN_SECONDS", default=60)
KVRUN_ENGINE_START_TIMEOUT_SECONDS = env.int("KVRUN_ENGINE_START_TIMEOUT_SECONDS", default=600)
KVRUN_ENGINE_STOP_GRACE_SECONDS = env.int("KVRUN_ENGINE_STOP_GRACE_SECONDS", default=15)
# Before an engine is stopped: how long its requests in flight may take to finish (the
# gateways stop sending it new ones first). Well under the reconciler's patience with a stop.
KVRUN_ENGINE_DRAIN_SECONDS = env.float("KVRUN_ENGINE_DRAIN_SECONDS", default=10.0)
# After this many failed starts in a row the endpoint is `failed` with the engine's last lines.
KVRUN_ENGINE_MAX_FAILURES = env.int("KVRUN_ENGINE_MAX_FAILURES", default=3)
KVRUN_ENGINE_BACKOFF_SECONDS = env.int("KVRUN_ENGINE_BACKOFF_SECONDS", default=5)
# RAM one CPU engine may use for weights, KV and runtime (CPU nodes only).
KVRUN_CPU_ENGINE_MEMORY_BYTES = env.int("KVRUN_CPU_ENGINE_MEMORY_BYTES", default=8 * 1024**3)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "accounts.authentication.APIKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": [
        "rest_framework.permissions.IsAuthenticated",
        "accounts.permissions.ManageScopeForKeys",
    ],
    "DEFAULT_PAGINATION_CLASS": "kvrun.common.api.Pagination",
    # The API takes JSON only, and its schema says so.
    "DEFAULT_PARSER_CLASSES": ["kvrun.common.parsers.JSONParser"],
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "kvrun.common.api.exception_handler",
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "kvrun API",
    "DESCRIPTION": ("Manage organisations, members, invites and API keys; read the model and GPU "
                    "catalogs; size, create, scale, stop and start endpoints and follow their "
                    "events. Inference is the OpenAI-compatible API under /v1/."),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums",
                             "kvrun.common.schema.document_errors"],
}

CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default=REDIS_URL)
# The worker waits on its queue with BRPOP for a second at a time; its reads may take longer.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "socket_timeout": KVRUN_REDIS_TIMEOUT_SECONDS + 5,
    "socket_connect_timeout": KVRUN_REDIS_TIMEOUT_SECONDS,
}
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_ROUTES = {
    "accounts.*": {"queue": "control"},
    "endpoints.*": {"queue": "control"},
    "billing.*": {"queue": "control"},
    "telemetry.*": {"queue": "control"},
    "scaling.*": {"queue": "control"},
}
CELERY_BEAT_SCHEDULE = {
    "endpoints.mark_lost_nodes": {
        "task": "endpoints.mark_lost_nodes",
        "schedule": float(KVRUN_NODE_HEARTBEAT_SECONDS),
    },
    "endpoints.reconcile": {"task": "endpoints.reconcile", "schedule": KVRUN_RECONCILE_SECONDS},
    "scaling.autoscale": {"task": "scaling.autoscale", "schedule": KVRUN_AUTOSCALE_SECONDS},
    "billing.ingest_usage": {"task": "billing.ingest_usage",
                             "schedule": KVRUN_USAGE_INGEST_SECONDS},
    "billing.roll_up_usage": {"task": "billing.roll_up_usage",
                              "schedule": KVRUN_BILLING_ROLLUP_SECONDS},
    "billing.finalize_invoices": {"task": "billing.finalize_invoices", "schedule": 300.0},
    "billing.enforce_budgets": {"task": "billing.enforce_budgets",
                                "schedule": float(KVRUN_BUDGET_CHECK_SECONDS)},
    "billing.prune_stripe_events": {"task": "billing.prune_stripe_events", "schedule": 3600.0},
    "telemetry.downsample_samples": {"task": "telemetry.downsample_samples", "schedule": 300.0},
    "telemetry.advise": {"task": "telemetry.advise", "schedule": 60.0},
}
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_SEND_TASK_EVENTS = False

# Production hardening; `manage.py check --deploy` passes with DEBUG=0.
SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=not DEBUG)
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
SESSION_COOKIE_SECURE = env.bool("SESSION_COOKIE_SECURE", default=not DEBUG)
CSRF_COOKIE_SECURE = env.bool("CSRF_COOKIE_SECURE", default=not DEBUG)
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=0 if DEBUG else 31536000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", default=not DEBUG)
SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=not DEBUG)
if env.bool("TRUST_X_FORWARDED_PROTO", default=False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    # httpx logs every request at INFO: the node agent's scrapes, every few seconds each.
    "loggers": {"httpx": {"level": "WARNING"}},
}
