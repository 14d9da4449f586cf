"""A stand-in for the Hugging Face Hub (these machines reach no hub): an aiohttp server that serves
local model folders over the HTTP routes the real `huggingface_hub` client uses for
`snapshot_download`, so the downloader is tested with the real library as the client.

Routes, as huggingface_hub 2.4 calls them (hf_api.py, file_download.py):

- GET  /api/models/ORG/NAME/revision/REV   model_info: {"id", "sha", ...}; the sha is the commit
- GET  /api/models/ORG/NAME/tree/REV       list_repo_tree (recursive): files with oid, size, lfs
- HEAD /ORG/NAME/resolve/REV/PATH          file metadata: X-Repo-Commit, ETag, Content-Length; an
                                           LFS file (safetensors) answers 302 to its CDN URL with
                                           X-Linked-Etag and X-Linked-Size, as the Hub does
- GET  /ORG/NAME/resolve/REV/PATH          the bytes (Range honoured)
- GET  /cdn/SHA256                         an LFS file's bytes, on a second port: the Hub's CDN is
                                           another origin, which the client asks without the token

Errors come in the Hub's shapes, which the client maps to its exceptions by the X-Error-Code
header: RepoNotFound (404), RevisionNotFound (404), GatedRepo (401, no token), and a wrong token
is 401 "Invalid credentials in Authorization header". Every request is recorded in `requests`
(method, path) so tests can count what the client fetched. Commits are content hashes of a
folder, so a revision is a folder: `Repo({"main": folder, "v1": older})`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def _blob_oid(data: bytes) -> str:
    """git's blob id, as the Hub lists it for every file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class File:
    path: str
    data: bytes

    @property
    def lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES)

    @property
    def oid(self) -> str:
        return _blob_oid(self.data)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def tree_entry(self) -> dict:
        entry = {"type": "file", "oid": self.oid, "size": len(self.data), "path": self.path}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": 134}
        return entry


@dataclass(frozen=True)
class Commit:
    sha: str
    files: dict[str, File]

    @classmethod
    def of_folder(cls, folder: Path) -> Commit:
        files = {
            str(p.relative_to(folder)): File(str(p.relative_to(folder)), p.read_bytes())
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
        digest = hashlib.sha1()
        for f in files.values():
            digest.update(f"{f.path}\0{f.oid}\n".encode())
        return cls(digest.hexdigest(), files)


@dataclass
class Repo:
    """A model repository: refs (branches, tags) -> folders. `gated`: needs the stand-in's token."""

    refs: dict[str, Path]
    gated: bool = True
    commits: dict[str, Commit] = field(init=False)
    heads: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.commits, self.heads = {}, {}
        for ref, folder in self.refs.items():
            commit = Commit.of_folder(folder)
            self.commits[commit.sha] = commit
            self.heads[ref] = commit.sha

    def resolve(self, revision: str) -> Commit | None:
        sha = self.heads.get(revision, revision)
        return self.commits.get(sha)


def _error(status: int, code: str | None, message: str) -> web.Response:
    headers = {"X-Error-Message": message}
    if code:
        headers["X-Error-Code"] = code
    return web.json_response({"error": message}, status=status, headers=headers)


class HubStandIn:
    """The stand-in Hub: `repos` by "ORG/NAME"; `token`: the one token it accepts for gated repos;
    `cdn_bytes_per_s`: stream LFS files at this rate (None: at once), so a download lasts long
    enough to be watched."""

    def __init__(
        self, repos: dict[str, Repo], token: str | None = None, cdn_bytes_per_s: float | None = None
    ) -> None:
        self.repos = repos
        self.token = token
        self.cdn_bytes_per_s = cdn_bytes_per_s
        self.requests: list[tuple[str, str]] = []
        self.cdn_url = ""  # set by `serving`: the CDN's origin (another port)
        self._lock = threading.Lock()
        self.app = web.Application(middlewares=[self._record])
        self.app.add_routes(
            [
                web.get("/api/models/{org}/{name}/revision/{revision}", self._model_info),
                web.get("/api/models/{org}/{name}/tree/{revision}", self._tree),
                web.route("*", "/{org}/{name}/resolve/{revision}/{path:.+}", self._resolve),
                web.get("/cdn/{sha256}", self._cdn),
            ]
        )

    def file_gets(self) -> list[str]:
        """The paths of the file downloads asked for so far (GETs of resolve or CDN URLs)."""
        with self._lock:
            return [p for m, p in self.requests if m == "GET" and ("/resolve/" in p or p.startswith("/cdn/"))]

    @web.middleware
    async def _record(self, request: web.Request, handler):
        with self._lock:
            self.requests.append((request.method, request.path))
        return await handler(request)

    def _lookup(self, request: web.Request) -> tuple[Repo, Commit] | web.Response:
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        repo = self.repos.get(repo_id)
        if repo is None:
            return _error(404, "RepoNotFound", "Repository not found")
        if repo.gated and self.token is not None:
            auth = request.headers.get("Authorization", "")
            if not auth:
                return _error(
                    401,
                    "GatedRepo",
                    f"Access to model {repo_id} is restricted. You must have access to it and be "
                    "authenticated to access it. Please log in.",
                )
            if auth != f"Bearer {self.token}":
                return _error(401, None, "Invalid credentials in Authorization header")
        revision = request.match_info["revision"]
        commit = repo.resolve(revision)
        if commit is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo, commit

    async def _model_info(self, request: web.Request) -> web.Response:
        found = self._lookup(request)
        if isinstance(found, web.Response):
            return found
        repo, commit = found
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        return web.json_response(
            {
                "id": repo_id,
                "modelId": repo_id,
                "sha": commit.sha,
                "private": False,
                "gated": "manual" if repo.gated else False,
                "siblings": [{"rfilename": p} for p in commit.files],
            }
        )

    async def _tree(self, request: web.Request) -> web.Response:
        found = self._lookup(request)
        if isinstance(found, web.Response):
            return found
        _, commit = found
        return web.json_response([f.tree_entry() for f in commit.files.values()])

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        found = self._lookup(request)
        if isinstance(found, web.Response):
            return found
        _, commit = found
        f = commit.files.get(request.match_info["path"])
        headers = {"X-Repo-Commit": commit.sha}
        if f is None:
            return web.Response(
                status=404,
                headers={**headers, "X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"},
            )
        if f.lfs:  # the Hub redirects LFS files to its CDN, saying the blob's etag and size
            headers.update(
                {
                    "Location": f"{self.cdn_url}/cdn/{f.sha256}",
                    "X-Linked-Etag": f'"{f.sha256}"',
                    "X-Linked-Size": str(len(f.data)),
                    "ETag": f'"{f.oid}"',
                }
            )
            return web.Response(status=302, headers=headers)
        headers["ETag"] = f'"{f.oid}"'
        return self._body(request, f.data, headers)

    async def _cdn(self, request: web.Request) -> web.StreamResponse:
        for repo in self.repos.values():
            for commit in repo.commits.values():
                for f in commit.files.values():
                    if f.lfs and f.sha256 == request.match_info["sha256"]:
                        if (
                            self.cdn_bytes_per_s
                            and request.method == "GET"
                            and request.http_range.start is None
                        ):
                            return await self._throttled(request, f.data, {"ETag": f'"{f.sha256}"'})
                        return self._body(request, f.data, {"ETag": f'"{f.sha256}"'})
        return web.Response(status=404)

    async def _throttled(
        self, request: web.Request, data: bytes, headers: dict[str, str]
    ) -> web.StreamResponse:
        """The body in 64 KiB pieces at cdn_bytes_per_s (data keeps flowing: no read timeout)."""
        response = web.StreamResponse(headers={**headers, "Content-Length": str(len(data))})
        await response.prepare(request)
        piece = 64 * 1024
        for start in range(0, len(data), piece):
            await response.write(data[start : start + piece])
            await asyncio.sleep(piece / self.cdn_bytes_per_s)
        await response.write_eof()
        return response

    @staticmethod
    def _body(request: web.Request, data: bytes, headers: dict[str, str]) -> web.Response:
        start = 0
        if request.http_range.start is not None:
            start = request.http_range.start
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        if request.method == "HEAD":
            return web.Response(status=200, headers={**headers, "Content-Length": str(len(body))})
        return web.Response(status=206 if start else 200, body=body, headers=headers)


@contextlib.contextmanager
def serving(standin: HubStandIn, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """The stand-in listening on host:port (0: a free port) in a thread of its own, and its CDN
    on another free port of host; yields the base URL (the HF_ENDPOINT to give the client)."""
    loop = asyncio.new_event_loop()
    started: dict[str, object] = {}
    ready = threading.Event()

    async def start() -> None:
        runner = web.AppRunner(standin.app, access_log=None)
        await runner.setup()
        site, cdn = web.TCPSite(runner, host, port), web.TCPSite(runner, host, 0)
        await site.start()
        await cdn.start()
        started["runner"] = runner
        started["port"] = site._server.sockets[0].getsockname()[1]  # the port the OS chose
        standin.cdn_url = f"http://{host}:{cdn._server.sockets[0].getsockname()[1]}"

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(start())
        except BaseException as e:
            started["error"] = e
            ready.set()
            return
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="hub-standin", daemon=True)
    thread.start()
    ready.wait(30)
    if "error" in started:
        raise started["error"]  # type: ignore[misc]
    try:
        yield f"http://{host}:{started['port']}"
    finally:
        asyncio.run_coroutine_threadsafe(started["runner"].cleanup(), loop).result(30)  # type: ignore[union-attr]
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
