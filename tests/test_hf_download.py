"""`kvscale-worker download`: the real huggingface_hub client against the Hub stand-in
(tests/hub_standin.py) serving the fixture model. A snapshot is the folder byte for byte, a
revision pin holds, each failure gives its one-line reason in the termination log and a non-zero
exit, and a complete snapshot is not fetched again."""

from __future__ import annotations

import logging
import shutil
import socket
import time
from pathlib import Path

import pytest
from hub_standin import HubStandIn, Repo, serving
from model_fixtures import DRAFT

from kvscale.worker.cli import main as cli
from kvscale.worker.model.download import MARKER, download, parse_uri

TOKEN = "hf_standin_token"
pytestmark = pytest.mark.skipif(not DRAFT.is_dir(), reason="needs ../shared/models/tiny-code-draft")


def files_of(folder: Path) -> dict[str, bytes]:
    """A model folder's files, without huggingface_hub's metadata and our marker."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and ".cache" not in p.relative_to(folder).parts and p.name != MARKER
    }


@pytest.fixture
def revisions(tmp_path) -> dict[str, Path]:
    """Two revisions of one model: v1 is the fixture folder, main adds a file and changes one."""
    v1 = DRAFT
    main = tmp_path / "main-src"
    shutil.copytree(DRAFT, main)
    for p in main.iterdir():
        p.chmod(0o644)
    (main / "README.md").write_text("# tiny\nthe newer revision\n")
    (main / "generation_config.json").write_text('{"max_new_tokens": 8}\n')
    return {"main": main, "v1": v1}


@pytest.fixture
def hub(revisions, monkeypatch, tmp_path):
    standin = HubStandIn({"kvscale/tiny": Repo(revisions)}, token=TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with serving(standin) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        yield standin


def run_cli(uri: str, dest: Path, termination_log: Path) -> int:
    return cli(
        [
            "--log-format",
            "text",
            "download",
            uri,
            "--dest",
            str(dest),
            "--termination-log",
            str(termination_log),
        ]
    )


def test_a_snapshot_is_the_model_folder_byte_for_byte(hub, revisions, tmp_path):
    dest, log = tmp_path / "model", tmp_path / "termination-log"
    assert run_cli("hf://kvscale/tiny", dest, log) == 0
    assert files_of(dest) == files_of(revisions["main"])
    assert not log.exists()
    assert any(p.startswith("/cdn/") for p in hub.file_gets())  # the safetensors went the LFS way


def test_a_revision_pin_gets_that_revision(hub, revisions, tmp_path):
    sha = hub.repos["kvscale/tiny"].heads["v1"]
    for uri in (f"hf://kvscale/tiny@{sha}", "hf://kvscale/tiny@v1"):
        dest = tmp_path / uri.rpartition("@")[2]
        assert run_cli(uri, dest, tmp_path / "log") == 0
        assert files_of(dest) == files_of(revisions["v1"]) != files_of(revisions["main"])


@pytest.mark.parametrize(
    ("uri", "token", "reason"),
    [
        (
            "hf://kvscale/tiny",
            "hf_wrong",
            "the Hub refused the token for kvscale/tiny (401): check the Secret in model.hfTokenSecret",
        ),
        ("hf://kvscale/tiny", None, "the Hub refused access to kvscale/tiny without a token (401)"),
        ("hf://kvscale/tiny@nope", TOKEN, "revision 'nope' not found in kvscale/tiny"),
        ("hf://kvscale/nope", TOKEN, "repository kvscale/nope not found"),
        ("hf://kvscale", TOKEN, "not a Hugging Face model URI"),
    ],
)
def test_each_failure_says_why_in_the_termination_log_and_exits_non_zero(
    hub, monkeypatch, tmp_path, uri, token, reason
):
    if token is None:
        monkeypatch.delenv("HF_TOKEN")
    else:
        monkeypatch.setenv("HF_TOKEN", token)
    log = tmp_path / "termination-log"
    assert run_cli(uri, tmp_path / "model", log) == 1
    message = log.read_text()
    assert reason in message and message.count("\n") == 1, message
    assert not hub.file_gets()


def test_an_unreachable_hub_says_so(monkeypatch, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    log = tmp_path / "termination-log"
    assert run_cli("hf://kvscale/tiny", tmp_path / "model", log) == 1
    assert f"cannot reach the Hub at http://127.0.0.1:{port} for kvscale/tiny" in log.read_text()


def test_a_complete_snapshot_is_not_fetched_again(hub, revisions, tmp_path, monkeypatch):
    dest, log = tmp_path / "model", tmp_path / "log"
    assert run_cli("hf://kvscale/tiny", dest, log) == 0
    fetched = len(hub.file_gets())
    assert fetched == len(files_of(revisions["main"]))

    hub.requests.clear()  # a branch: one revision lookup, no file
    assert run_cli("hf://kvscale/tiny", dest, log) == 0
    assert hub.file_gets() == [] and [p for _, p in hub.requests] == [
        "/api/models/kvscale/tiny/revision/main"
    ]

    sha = hub.repos["kvscale/tiny"].heads["main"]  # a commit hash: no request at all
    hub.requests.clear()
    assert run_cli(f"hf://kvscale/tiny@{sha}", dest, log) == 0
    assert hub.requests == []

    # The Hub gone: the complete snapshot of the branch serves as it is.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert run_cli("hf://kvscale/tiny", dest, log) == 0
    assert files_of(dest) == files_of(revisions["main"])


def test_an_interrupted_download_is_completed_not_trusted(hub, revisions, tmp_path):
    dest, log = tmp_path / "model", tmp_path / "log"
    assert run_cli("hf://kvscale/tiny", dest, log) == 0
    (dest / MARKER).unlink()  # as if the pod died before the end
    (dest / "tokenizer.json").unlink()
    hub.requests.clear()
    assert run_cli("hf://kvscale/tiny", dest, log) == 0
    assert files_of(dest) == files_of(revisions["main"])
    assert [p.rpartition("/")[2] for p in hub.file_gets()] == ["tokenizer.json"]


@pytest.mark.parametrize(
    ("uri", "repo", "revision"),
    [
        ("hf://kvscale/tiny", "kvscale/tiny", "main"),
        ("hf://Org_1/Model.v2-x@refs/pr/1", "Org_1/Model.v2-x", "refs/pr/1"),
        (
            "hf://a/b@0123456789abcdef0123456789abcdef01234567",
            "a/b",
            "0123456789abcdef0123456789abcdef01234567",
        ),
    ],
)
def test_uris_parse(uri, repo, revision):
    model = parse_uri(uri)
    assert (model.repo, model.revision) == (repo, revision)


@pytest.mark.parametrize(
    "uri", ["hf://", "hf://onlyorg", "hf://a/b@", "hf://a/b/c", "hf://a/b@x..y", "hf://-a/b"]
)
def test_bad_uris_are_refused(uri):
    with pytest.raises(ValueError, match="not a Hugging Face model URI"):
        parse_uri(uri)


def test_a_long_download_logs_its_progress(revisions, monkeypatch, tmp_path, caplog):
    standin = HubStandIn({"kvscale/tiny": Repo(revisions)}, token=TOKEN, cdn_bytes_per_s=4 * 2**20)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    caplog.set_level(logging.INFO, logger="kvscale.worker.download")
    with serving(standin) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        started = time.monotonic()
        download(parse_uri("hf://kvscale/tiny@v1"), tmp_path / "model", progress_s=0.2)
        took = time.monotonic() - started
    assert took >= 0.9  # 4 MB of safetensors at 4 MiB/s
    assert files_of(tmp_path / "model") == files_of(revisions["v1"])
    progress = [r.getMessage() for r in caplog.records if "MiB on disk" in r.getMessage()]
    assert len(progress) >= 2, progress
    assert any(r.getMessage().startswith("downloaded hf://kvscale/tiny@v1 (commit ") for r in caplog.records)


def test_a_branch_that_moved_is_updated_in_place_without_stale_files(hub, revisions, tmp_path):
    dest, log = tmp_path / "model", tmp_path / "log"
    assert run_cli("hf://kvscale/tiny", dest, log) == 0
    assert (dest / "README.md").is_file()
    hub.repos["kvscale/tiny"] = Repo({"main": revisions["v1"]})  # main now points at v1's files
    hub.requests.clear()
    assert run_cli("hf://kvscale/tiny", dest, log) == 0
    assert files_of(dest) == files_of(revisions["v1"])  # README.md gone, generation_config back
    # Only what changed was fetched.
    assert sorted(p.rpartition("/")[2] for p in hub.file_gets()) == ["generation_config.json"]


def test_offline_mode_says_so_and_a_complete_snapshot_still_serves(hub, revisions, tmp_path, monkeypatch):
    import huggingface_hub.constants

    dest, log = tmp_path / "model", tmp_path / "log"
    assert run_cli("hf://kvscale/tiny", dest, log) == 0
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 at start
    assert run_cli("hf://kvscale/tiny", dest, log) == 0  # the complete snapshot, as it is
    assert run_cli("hf://kvscale/tiny@v1", tmp_path / "other", log) == 1
    assert "HF_HUB_OFFLINE is set, so hf://kvscale/tiny@v1 cannot be downloaded" in log.read_text()


def test_an_interrupted_update_of_a_branch_is_not_taken_for_the_old_snapshot(
    hub, revisions, tmp_path, monkeypatch
):
    dest, log = tmp_path / "model", tmp_path / "log"
    assert run_cli("hf://kvscale/tiny@v1", dest, log) == 0
    hub.repos["kvscale/tiny"] = Repo({"v1": revisions["main"]})  # the tag moved

    def interrupted(*args, **kwargs):
        (dest / "README.md").write_text("half of the new commit")
        raise KeyboardInterrupt  # the pod killed mid-download

    monkeypatch.setattr("huggingface_hub.snapshot_download", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_cli("hf://kvscale/tiny@v1", dest, log)
    monkeypatch.undo()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the Hub gone: no snapshot to fall back on
    assert run_cli("hf://kvscale/tiny@v1", dest, log) == 1
    assert "cannot reach the Hub" in log.read_text()
