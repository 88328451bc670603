"""Publishing through the real huggingface_hub client against a local recording Hub."""

from __future__ import annotations

import pytest

from eagle3kit.errors import InputError
from eagle3kit.formats import export_draft
from eagle3kit.hub import push as hub_push
from tests.formats.helpers import make_draft, tiny_target
from tests.hub.hub_server import hub_server

TOKEN = "hf_test_0123456789abcdef"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture()
def export(target, tmp_path):
    out = export_draft(make_draft(target), "sglang", tmp_path / "sglang")
    hub_push.write_card(out, "---\nlicense: apache-2.0\n---\n"
                             f"{hub_push.card.MARKER}\n# card\n")
    return out


@pytest.fixture()
def hub(monkeypatch):
    """The local Hub; the suite's offline switch (read once at import) is lifted for it."""
    import huggingface_hub.constants

    with hub_server() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield server


def test_one_commit_with_every_file(export, hub):
    plan = hub_push.plan_push(export, "my-org/tiny-Eagle3", private=True,
                              commit_message="first draft")
    assert [n for n, _ in plan.files] == ["README.md", "config.json", "eagle3kit.json",
                                          "model.safetensors"]
    url = hub_push.push(plan, TOKEN)
    assert url == f"{hub.url}/my-org/tiny-Eagle3/commit/c0ffee"
    create = [r for r in hub.requests if r.path == "/api/repos/create"]
    assert create[0].json() == {"name": "tiny-Eagle3", "organization": "my-org",
                                "visibility": "private", "type": "model"}
    files = hub.committed_files()
    assert files == {n: (export / n).read_bytes() for n, _ in plan.files}
    commit = next(r for r in hub.requests if "/commit/" in r.path)
    assert commit.path == "/api/models/my-org/tiny-Eagle3/commit/main"
    assert commit.ndjson()[0]["value"]["summary"] == "first draft"
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub.requests)


def test_branch_is_created_for_a_revision(export, hub):
    hub_push.push(hub_push.plan_push(export, "my-org/x", revision="v2"), TOKEN)
    paths = [r.path for r in hub.requests]
    assert "/api/models/my-org/x/branch/v2" in paths
    assert "/api/models/my-org/x/commit/v2" in paths


def test_hub_errors_are_one_line_without_the_token(export, hub):
    hub.fail_with["/api/repos/create"] = 403
    with pytest.raises(hub_push.PushError) as e:
        hub_push.push(hub_push.plan_push(export, "my-org/x"), TOKEN)
    message = str(e.value)
    assert "push to my-org/x failed (create the repository)" in message and "403" in message
    assert TOKEN not in message and "\n" not in message
    assert not any("/commit/" in r.path for r in hub.requests)


def test_no_token(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    # no stored login either (the path is read once, at import)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    with pytest.raises(hub_push.PushError, match="no Hugging Face token: set HF_TOKEN"):
        hub_push.resolve_token()


def test_card_written_by_a_user_is_kept(export):
    (export / "README.md").write_text("# my own card\n")
    path, written = hub_push.write_card(export, "generated")
    assert not written and path.read_text() == "# my own card\n"


def test_plan_refuses_incomplete_exports(export):
    (export / "README.md").unlink()
    with pytest.raises(InputError, match="incomplete export: missing README.md"):
        hub_push.plan_push(export, "my-org/x")
    with pytest.raises(InputError, match="is not ORG/NAME"):
        hub_push.check_repo_id("no-slash")
