"""A real S3 API on loopback: moto's server (moto.server.ThreadedMotoServer) on 127.0.0.1 and a
port the OS picks, as a session fixture other test modules reuse. It starts in well under a
second; buckets are cheap, so each test makes its own (``create_bucket()``).

``S3Server(process=True)`` runs moto in a process of its own instead (its auth setting and
buckets its own), which ``stop()`` kills the way an outage takes a store away.

Credentials are enforced, so wrong ones are refused the way AWS refuses them: before enabling
moto's IAM authentication (``POST /moto-api/reset-auth`` with 0, i.e.
INITIAL_NO_AUTH_ACTION_COUNT=0) the fixture creates, through the server's own IAM API, a user
allowed everything and one allowed nothing, each with an access key. ``env`` carries the first;
``env_with(...)`` changes any variable (a wrong secret: SignatureDoesNotMatch; an unknown key id:
InvalidAccessKeyId); ``denied_env`` carries the second (AccessDenied).

    from s3_server import s3_server, s3_env         # a test module in tests/adapters
    def test_x(s3_env):                              # AWS_* of the server set for the test
        bucket = s3_env.create_bucket()
        subprocess.run([...], env={**os.environ, **s3_env.env})   # a replica sees it too
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from loragw.gateway.bench.server import free_port

REGION = "us-east-1"
START_TIMEOUT_S = 30.0  # moto's server in a process of its own: imports, then it listens
BOOTSTRAP_KEY = "testing"  # moto accepts any key while authentication is off
_ALLOW_ALL = {"Version": "2012-10-17",
              "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}  # fmt: skip
# Variables that would otherwise leak in from the developer's machine and change the client.
CLEARED_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION")


class S3Server:
    """moto's S3 (and IAM) on 127.0.0.1; ``env`` is what a client or replica process needs."""

    def __init__(self, process: bool = False) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request
        self._server = None if process else ThreadedMotoServer(ip_address="127.0.0.1", port=0,
                                                               verbose=False)
        self._process: subprocess.Popen | None = None
        self._names = itertools.count()
        self.endpoint = ""
        self.env: dict[str, str] = {}
        self.denied_env: dict[str, str] = {}

    def start(self) -> None:
        if self._server is None:
            self._start_process()
        else:
            self._server.start()
            host, port = self._server.get_host_and_port()
            self.endpoint = f"http://{host}:{port}"
        admin = self._make_user("lora-gateway", _ALLOW_ALL)
        nobody = self._make_user("nobody", None)
        self._set_auth(0)  # from here on every request must be signed by a known key
        self.env = self._env(*admin)
        self.denied_env = self._env(*nobody)

    def stop(self) -> None:
        if self._process is not None:  # its process goes, and its buckets with it
            self._process.kill()
            self._process.wait(timeout=10)
        elif self.endpoint:
            self._set_auth(float("inf"))  # the setting is process-wide in moto: leave it off
            self._server.stop()

    def _start_process(self) -> None:
        port = free_port()  # moto's own pick is not printed reliably
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/data.json", timeout=1):
                    return
            except (urllib.error.URLError, ConnectionError):
                assert self._process.poll() is None, "moto's server process exited at start"
                assert time.monotonic() < deadline, f"moto's server never answered on {port}"
                time.sleep(0.1)

    def env_with(self, **changes: str) -> dict[str, str]:
        """``env`` with some variables changed: env_with(AWS_SECRET_ACCESS_KEY="wrong")."""
        return {**self.env, **changes}

    def client(self, env: dict[str, str] | None = None):
        """A boto3 S3 client of its own (not the gateway's factory), for setting up tests."""
        import boto3
        from botocore.config import Config

        env = env or self.env
        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=REGION,
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}),
        )  # fmt: skip

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh name unless given) and return its name."""
        name = name or f"bucket-{next(self._names)}"
        self.client().create_bucket(Bucket=name)
        return name

    def _env(self, key_id: str, secret: str) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": key_id,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",  # never wait on instance metadata
        }

    def _make_user(self, name: str, policy: dict | None) -> tuple[str, str]:
        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name=REGION,
                           aws_access_key_id=BOOTSTRAP_KEY,
                           aws_secret_access_key=BOOTSTRAP_KEY)  # fmt: skip
        iam.create_user(UserName=name)
        if policy is not None:
            iam.put_user_policy(UserName=name, PolicyName="policy",
                                PolicyDocument=json.dumps(policy))  # fmt: skip
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def _set_auth(self, initial_no_auth_action_count: float) -> None:
        """moto's INITIAL_NO_AUTH_ACTION_COUNT, through its management API (moto-api)."""
        request = urllib.request.Request(  # text/plain: a form body would reach moto empty
            f"{self.endpoint}/moto-api/reset-auth", method="POST",
            data=str(initial_no_auth_action_count).encode(), headers={"Content-Type": "text/plain"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=5) as response:
            assert json.load(response)["status"] == "ok"


_shared: S3Server | None = None


def shared_server() -> S3Server:
    """The process's one S3 server, started on first use and stopped at exit: moto's auth
    setting is process-wide, so two servers in one process would fight over it."""
    global _shared
    if _shared is None:
        _shared = S3Server()
        _shared.start()
        atexit.register(_shared.stop)
    return _shared


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server for the session, credentials enforced; see the module docstring."""
    yield shared_server()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """s3_server, with its ``env`` set in os.environ for this test (and other AWS_* cleared)."""
    for name in CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server
