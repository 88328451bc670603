"""Publishing an export directory to the Hub in one commit, with its model card.

    plan = plan_push(export_dir, repo_id, ...)   # what would be uploaded; touches no network
    write_card(export_dir, text)                 # README.md, unless the user wrote their own
    url = push(plan, token=resolve_token())      # create the repo if missing, one commit

The token comes from where huggingface_hub looks (HF_TOKEN, then the stored login) and is
never printed: error messages from the Hub are scrubbed of it. The endpoint is read from
HF_ENDPOINT at call time, so a mirror or a local test server works without re-importing.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from eagle3kit.errors import InputError, UserError
from eagle3kit.formats import common
from eagle3kit.hub import card
from eagle3kit.io.atomic import atomic_path
from eagle3kit.io.hub import HUB_ID

README = "README.md"
# the files an export must have; anything else in the directory is uploaded as well
REQUIRED = ("config.json", common.WEIGHTS, common.SIDECAR)


class PushError(UserError):
    """The Hub refused or could not be reached (exit 6)."""

    exit_code = 6


@dataclasses.dataclass(frozen=True)
class PushPlan:
    export_dir: Path
    repo_id: str
    revision: str
    private: bool
    commit_message: str
    files: tuple[tuple[str, int], ...]  # (name, bytes), README.md included

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def check_repo_id(repo_id: str) -> str:
    if not HUB_ID.match(repo_id):
        raise InputError(f"--repo-id {repo_id!r} is not ORG/NAME")
    return repo_id


def card_path(export_dir: str | os.PathLike) -> Path:
    return Path(export_dir) / README


def write_card(export_dir: str | os.PathLike, text: str) -> tuple[Path, bool]:
    """Writes README.md atomically; a README.md without eagle3kit's marker is the user's and
    is kept. Returns (path, written)."""
    path = card_path(export_dir)
    if path.is_file() and not card.is_generated(path.read_text(errors="replace")):
        return path, False
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return path, True


def plan_push(export_dir: str | os.PathLike, repo_id: str, *, revision: str = "main",
              private: bool = False, commit_message: str | None = None) -> PushPlan:
    """What `push` would upload. The export must be complete; README.md must exist."""
    directory = Path(export_dir)
    meta = card.read_export(directory)
    missing = [f for f in (*REQUIRED, README) if not (directory / f).is_file()]
    if missing:
        raise InputError(f"incomplete export: missing {', '.join(missing)}", path=directory)
    files = tuple(sorted((p.name, p.stat().st_size) for p in directory.iterdir()
                         if p.is_file() and not p.name.startswith(".")))
    message = commit_message or (f"Upload EAGLE3 draft for {meta['target']['name']} "
                                 f"({meta['engine_format']} format, eagle3kit)")
    return PushPlan(directory, check_repo_id(repo_id), revision or "main", private, message,
                    files)


def resolve_token() -> str:
    """The Hub token from HF_TOKEN or the stored login; a clear error when there is none."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise PushError("no Hugging Face token: set HF_TOKEN or run `hf auth login` "
                        "(or use --dry-run)")
    return token


def _scrub(text: str, token: str) -> str:
    return text.replace(token, "***") if token else text


def push(plan: PushPlan, token: str) -> str:
    """Creates the repo if missing (and the branch), uploads every file in one commit.
    Returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    step = "create the repository"
    try:
        api.create_repo(plan.repo_id, private=plan.private, exist_ok=True, repo_type="model")
        if plan.revision != "main":
            step = f"create the branch {plan.revision!r}"
            api.create_branch(plan.repo_id, branch=plan.revision, exist_ok=True)
        step = "commit"
        ops = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=plan.export_dir / name)
               for name, _ in plan.files]
        info = api.create_commit(plan.repo_id, operations=ops,
                                 commit_message=plan.commit_message, revision=plan.revision,
                                 repo_type="model")
    except Exception as e:  # HTTP errors, auth, network: one line, never the token
        detail = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        detail = detail if len(detail) <= 400 else detail[:397] + "..."
        raise PushError(_scrub(f"push to {plan.repo_id} failed ({step}): {type(e).__name__}: "
                               f"{detail}", token)) from None
    return str(info.commit_url)
