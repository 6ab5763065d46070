"""What a `rqllm serve` process is configured with (CLI options and environment)."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from engine.defaults import DEFAULT_MODEL

KEYS_ENV = "RQLLM_API_KEYS"  # one or more keys, separated by commas or whitespace

# OpenAI's limits for a batch input file
DEFAULT_MAX_FILE_BYTES = 200 * 1000 * 1000
DEFAULT_MAX_FILE_REQUESTS = 50_000
# Any other request body (a chat completion's JSON): far above what the prompt limit lets through.
DEFAULT_MAX_BODY_BYTES = 8 << 20
# What a multipart upload may carry besides the file itself (boundaries, headers, the purpose field).
MULTIPART_ENVELOPE_BYTES = 64 << 10


def default_data_dir() -> Path:
    from engine.registry import cache_dir

    return cache_dir() / "api"


def keys_from_env() -> list[str]:
    return os.environ.get(KEYS_ENV, "").replace(",", " ").split()


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
            self.data_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(uuid.uuid4().hex + "\n")
            os.replace(tmp, path)
            return path.read_text().strip()
