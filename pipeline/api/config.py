"""What a `rqllm serve` process is configured with (CLI options and environment)."""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.defaults import DEFAULT_MODEL
from engine.files import atomic_write
from jobs.redis_conn import refuse_placeholder_password

KEYS_ENV = "RQLLM_API_KEYS"  # one or more keys, separated by commas or whitespace

# OpenAI's limits for a batch input file
DEFAULT_MAX_FILE_BYTES = 200 * 1000 * 1000
DEFAULT_MAX_FILE_REQUESTS = 50_000
# Any other request body (a chat completion's JSON): far above what the prompt limit lets through.
DEFAULT_MAX_BODY_BYTES = 8 << 20
# What a multipart upload may carry besides the file itself (boundaries, headers, the purpose field).
MULTIPART_ENVELOPE_BYTES = 64 << 10

# Per-key limits (429 above them), each also settable through its environment variable:
# requests one key has in flight at once (a stream counts until it ends), ...
MAX_REQUESTS_IN_FLIGHT_ENV = "RQLLM_MAX_REQUESTS_IN_FLIGHT_PER_KEY"
DEFAULT_MAX_REQUESTS_IN_FLIGHT = 64
# ... batches not yet ended (validating, in_progress, finalizing, cancelling), ...
MAX_ACTIVE_BATCHES_ENV = "RQLLM_MAX_ACTIVE_BATCHES_PER_KEY"
DEFAULT_MAX_ACTIVE_BATCHES = 100
# ... and the request lines those batches hold together.
MAX_ACTIVE_LINES_ENV = "RQLLM_MAX_ACTIVE_LINES_PER_KEY"
DEFAULT_MAX_ACTIVE_LINES = 500_000


def default_data_dir() -> Path:
    from engine.registry import cache_dir

    return cache_dir() / "api"


def keys_from_env() -> list[str]:
    return os.environ.get(KEYS_ENV, "").replace(",", " ").split()


def normalize_keys(keys: Iterable[str]) -> list[str]:
    """API keys as every check sees them: surrounding whitespace stripped, duplicates dropped. A blank
    key (empty, or only whitespace) is refused with ValueError, as is one holding whitespace or control
    characters inside: it would count as a configured key in one place and as none in another."""
    out: list[str] = []
    for i, raw in enumerate(keys, 1):
        key = raw.strip()
        if not key:
            raise ValueError(f"API key #{i} is blank (empty or only whitespace)")
        if any(c.isspace() or not c.isprintable() for c in key):
            raise ValueError(f"API key #{i} holds whitespace or control characters")
        if key not in out:
            out.append(key)
    return out


_SETTING_NAMES = {"api_keys": "--api-key / RQLLM_API_KEYS", "redis_url": "--redis-url / REDIS_URL"}


def config_error(e: ValueError) -> str:
    """One line naming what is wrong with a ServeConfig (a pydantic ValidationError or a ValueError)."""
    from pydantic import ValidationError

    if not isinstance(e, ValidationError):
        return str(e)
    parts = []
    for err in e.errors(include_url=False):
        where = ".".join(str(x) for x in err["loc"])
        parts.append(f"{_SETTING_NAMES.get(where, where)}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def _env_limit(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name}={raw!r} is not a whole number >= 1")
    return int(raw)


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    redis_url: str
    data_dir: Path = Field(default_factory=default_data_dir)
    api_keys: list[str] = Field(default_factory=list, repr=False)
    insecure_no_auth: bool = False  # no keys and still reachable from other hosts
    default_model: str = DEFAULT_MODEL  # for requests whose body names no model
    max_file_bytes: int = Field(DEFAULT_MAX_FILE_BYTES, ge=1)
    max_file_requests: int = Field(DEFAULT_MAX_FILE_REQUESTS, ge=1)
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1)
    job_timeout: int | None = Field(None, ge=1, description="per-job timeout in seconds (default: the queue's)")
    batch_retries: int = Field(0, ge=0, description="retries for batch jobs that fail in a worker")
    completion_window_seconds: int = Field(24 * 3600, ge=1)
    max_requests_in_flight_per_key: int = Field(
        default_factory=lambda: _env_limit(MAX_REQUESTS_IN_FLIGHT_ENV, DEFAULT_MAX_REQUESTS_IN_FLIGHT), ge=1)
    max_active_batches_per_key: int = Field(
        default_factory=lambda: _env_limit(MAX_ACTIVE_BATCHES_ENV, DEFAULT_MAX_ACTIVE_BATCHES), ge=1)
    max_active_lines_per_key: int = Field(
        default_factory=lambda: _env_limit(MAX_ACTIVE_LINES_ENV, DEFAULT_MAX_ACTIVE_LINES), ge=1)

    @field_validator("api_keys")
    @classmethod
    def _keys_normalised(cls, v: list[str]) -> list[str]:
        return normalize_keys(v)

    @field_validator("redis_url")
    @classmethod
    def _no_placeholder_password(cls, v: str) -> str:
        refuse_placeholder_password(v)  # a ValueError naming the problem
        return v

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"

    @property
    def batches_dir(self) -> Path:
        return self.data_dir / "batches"

    @property
    def tmp_dir(self) -> Path:
        return self.data_dir / "tmp"

    def make_dirs(self) -> None:
        for d in (self.files_dir, self.batches_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)

    def home_id(self) -> str:
        """This data directory's id (made on first use): a server resumes only the batches whose files
        and working files live here, when several servers with their own data dirs share one Redis."""
        path = self.data_dir / "home-id"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            with atomic_write(path, "w") as f:
                f.write(uuid.uuid4().hex + "\n")
            return path.read_text().strip()
