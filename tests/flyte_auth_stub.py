"""A loopback stand-in for FlyteAdmin with authentication on, for tests/test_cluster_auth.py:
the gRPC AuthMetadataService that flytekit asks where to get a token, an OAuth2 token
endpoint that grants the client-credentials client CLIENT_ID with CLIENT_SECRET, and
AdminService.GetVersion (what `pyflyte info` calls), refused as UNAUTHENTICATED unless the
call carries that token. Each GetVersion call's authorization header is appended to a
log file, one JSON line each.

    python tests/flyte_auth_stub.py GRPC_PORT TOKEN_PORT LOG
"""

from __future__ import annotations

import base64
import json
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from flyteidl.admin import version_pb2
from flyteidl.service import admin_pb2_grpc, auth_pb2, auth_pb2_grpc

CLIENT_ID = "dapo-ci"
CLIENT_SECRET = "ci-secret-0"
TOKEN = "token-for-dapo-ci"
HEADER = "flyte-authorization"  # flyte-binary's authorization_metadata_key
BACKEND_VERSION = "v1.16.6"


class TokenEndpoint(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        expected = "Basic " + base64.b64encode(f"{CLIENT_ID}:{CLIENT_SECRET}".encode()).decode()
        if self.headers.get("Authorization") == expected:
            status, body = 200, {"access_token": TOKEN, "token_type": "bearer", "expires_in": 3600}
        else:
            status, body = 401, {"error": "invalid_client", "error_description": "client authentication failed"}
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


class AuthMetadata(auth_pb2_grpc.AuthMetadataServiceServicer):
    def __init__(self, token_port: int):
        self.token_url = f"http://127.0.0.1:{token_port}/oauth2/token"

    def GetOAuth2Metadata(self, request, context):  # noqa: N802 (gRPC's names)
        return auth_pb2.OAuth2MetadataResponse(issuer="http://127.0.0.1", token_endpoint=self.token_url,
                                               grant_types_supported=["client_credentials"], scopes_supported=["all"])

    def GetPublicClientConfig(self, request, context):  # noqa: N802
        return auth_pb2.PublicClientAuthConfigResponse(client_id="flytectl", redirect_uri="http://localhost:53593/callback",
                                                       scopes=["all"], authorization_metadata_key=HEADER)


class Admin(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, log: str):
        self.log = log
        self.lock = threading.Lock()

    def GetVersion(self, request, context):  # noqa: N802
        presented = dict(context.invocation_metadata()).get(HEADER)
        with self.lock, open(self.log, "a") as out:
            out.write(json.dumps({"authorization": presented}) + "\n")
        if presented != f"Bearer {TOKEN}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "request has no valid bearer token")
        return version_pb2.GetVersionResponse(control_plane_version=version_pb2.Version(Version=BACKEND_VERSION))


def main(grpc_port: int, token_port: int, log: str) -> None:
    tokens = ThreadingHTTPServer(("127.0.0.1", token_port), TokenEndpoint)
    threading.Thread(target=tokens.serve_forever, daemon=True).start()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    auth_pb2_grpc.add_AuthMetadataServiceServicer_to_server(AuthMetadata(token_port), server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(Admin(log), server)
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
