"""Real servers on loopback for the tests: moto's S3 server and an MLflow tracking server,
each in a process of its own."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

BUCKET = "dapo"
S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1")


def serve(command: list[str], port: int, log: Path, env: dict[str, str], preexec_fn=None) -> subprocess.Popen:
    """Start a server in a session of its own (stop() ends it with all its children), its
    output in log, and wait until it listens on port."""
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=output, env=env, preexec_fn=preexec_fn, start_new_session=True)
    deadline = time.time() + 90
    while time.time() < deadline and process.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return process
        except OSError:
            time.sleep(0.3)
    stop(process)
    raise RuntimeError(f"{command[:4]} did not start on port {port}: {log.read_text()[-2000:]}")


def start_s3(workdir: Path) -> tuple[subprocess.Popen, str]:
    """moto's S3 server with the bucket BUCKET; objects it spools go under workdir (in a
    process of its own: in the tests' process its Flask app would leave context-bound
    proxies in sys.modules, which vLLM's kernel registry trips over)."""
    port = free_port()
    process = serve([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, workdir / "moto.log",
                    {**os.environ, "TMPDIR": str(workdir)})
    endpoint = f"http://127.0.0.1:{port}"
    s3_client(endpoint).create_bucket(Bucket=BUCKET)
    return process, endpoint


def start_mlflow(
    store: Path, port: int = 0, artifacts: str = "", s3_endpoint: str = "", file_limit_bytes: int = 0
) -> tuple[subprocess.Popen, str]:
    """`mlflow server --serve-artifacts` on a sqlite store in store, on port (0 = a free one); artifacts: its
    --artifacts-destination ("" = store/artifacts; s3://... with s3_endpoint, on that server);
    file_limit_bytes: the most any file the server writes may hold (RLIMIT_FSIZE), a temp
    space smaller than what it is sent."""
    port = port or free_port()
    env = {**os.environ, **S3_ENV, "MLFLOW_S3_ENDPOINT_URL": s3_endpoint} if s3_endpoint else dict(os.environ)

    def limit_files() -> None:
        if file_limit_bytes:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit_bytes, file_limit_bytes))

    process = serve(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--serve-artifacts",
         "--backend-store-uri", f"sqlite:///{store / 'server.db'}", "--artifacts-destination", artifacts or str(store / "artifacts"),
         "--workers", "1"],
        port, store / "mlflow-server.log", env, preexec_fn=limit_files,
    )
    return process, f"http://127.0.0.1:{port}"


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, 9)
    process.wait(timeout=30)
