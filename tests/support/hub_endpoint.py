"""A local stand-in for the Hub's HTTP API, enough for huggingface_hub's create_repo, model card lookup,
create_branch and create_commit: it records every request and every commit's files, so a test can
check what a real `huggingface_hub` client published (no network; HF_ENDPOINT points here).

Every file is answered as a "regular" (non-LFS) upload, so its bytes arrive inside the commit itself.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubEndpoint:
    def __init__(self):
        self.requests: list[tuple[str, str, dict | None]] = []  # (method, path, JSON body)
        self.commits: list[dict] = []  # {"repo", "revision", "message", "files": {path: bytes}}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubEndpoint:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _handler(hub: HubEndpoint):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _reply(self, status: int, body: dict | None = None, headers: dict | None = None) -> None:
            data = json.dumps(body or {}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def do_HEAD(self):
            hub.requests.append(("HEAD", self.path, None))
            self._reply(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})

        do_GET = do_HEAD  # no file exists in any repo: the model card is made from the template

        def do_POST(self):
            raw = self._body()
            path = self.path.split("?")[0]
            if (commit := re.fullmatch(r"/api/models/(.+)/commit/([^/]+)", path)) is not None:
                hub.requests.append(("POST", self.path, None))
                self._commit(commit.group(1), commit.group(2), raw)
                return
            body = json.loads(raw or b"{}")
            hub.requests.append(("POST", self.path, body))
            if path == "/api/repos/create":
                repo = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
                self._reply(200, {"url": f"{hub.url}/{repo}", "name": repo})
            elif re.fullmatch(r"/api/models/.+/preupload/[^/]+", path):
                files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in body["files"]]
                self._reply(200, {"files": files})
            else:  # validate-yaml, branch creation
                self._reply(200, {})

        def _commit(self, repo: str, revision: str, raw: bytes) -> None:
            lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
            header = next(line["value"] for line in lines if line["key"] == "header")
            files = {
                line["value"]["path"]: base64.b64decode(line["value"]["content"])
                for line in lines
                if line["key"] == "file"
            }
            hub.commits.append({"repo": repo, "revision": revision, "message": header["summary"], "files": files})
            oid = f"{len(hub.commits):040x}"
            self._reply(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None})

    return Handler
