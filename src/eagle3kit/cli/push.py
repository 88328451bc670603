"""`eagle3kit push`: publish a converted draft with its model card."""

from __future__ import annotations

from pathlib import Path

import typer

from eagle3kit.cli._common import console, example, handle_errors, styled
from eagle3kit.cli.convert import route_warnings
from eagle3kit.errors import plural

EXAMPLE = """
eagle3kit push export/sglang --repo-id my-org/SmolLM2-Eagle3 \\
  --eval eval-mtbench.json --dry-run
eagle3kit push export/sglang --repo-id my-org/SmolLM2-Eagle3 \\
  --eval eval-mtbench.json --private
"""


@handle_errors
def push(
    export_dir: Path = typer.Argument(..., help="Directory written by `eagle3kit convert`."),
    repo_id: str = typer.Option(..., help="Hub repository, ORG/NAME (created if missing)."),
    eval_results: list[str] = typer.Option([], "--eval", help="JSON from `eagle3kit eval "
                                           "--json` for the card's acceptance table "
                                           "(repeatable; - reads stdin)."),
    private: bool = typer.Option(False, "--private", help="Create the repository private."),
    revision: str = typer.Option("main", help="Branch to commit to (created if missing)."),
    commit_message: str | None = typer.Option(None, help="Commit message."),
    license_id: str | None = typer.Option(None, "--license", help="License id for the card "
                                          "(default: the target's, where known)."),
    recipe: str | None = typer.Option(None, help="What produced the draft (e.g. a recipe's "
                                      "file and version), named in the card's training "
                                      "details."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write README.md and list what "
                                 "would be uploaded; no network."),
) -> None:
    """Upload a converted draft to the Hugging Face Hub, with a model card.

    Writes README.md into the export first: front matter (base_model,
    library_name, license, tags), SGLang and vLLM usage with this draft's
    exact flags, the training table from the run's recorded configuration,
    the acceptance tables from --eval results. A README.md you wrote
    yourself (no eagle3kit marker line) is kept. Then creates the repo if
    missing and uploads everything in one commit. The token comes from
    HF_TOKEN or `hf auth login` and is never printed.
    """
    from eagle3kit.hub import card
    from eagle3kit.hub import push as hub_push

    route_warnings()
    evals = [e for path in eval_results for e in card.load_evals(path)]
    hub_push.check_repo_id(repo_id)
    text = card.render_card(export_dir, repo_id, evals=evals, license=license_id,
                            recipe=recipe)
    token = None if dry_run else hub_push.resolve_token()  # fail before writing anything
    path, written = hub_push.write_card(export_dir, text)
    if written:
        console.print(f"wrote model card {path}")
    else:
        console.print(styled(f"keeping {path}", "yellow", ": it was not written by eagle3kit"))
    plan = hub_push.plan_push(export_dir, repo_id, revision=revision, private=private,
                              commit_message=commit_message)
    visibility = "private" if plan.private else "public"
    head = "dry run: would upload" if dry_run else "uploading"
    console.print(f"{head} {plural(len(plan.files), 'file')} ({plan.total_bytes / 1e6:.1f} MB) to "
                  f"{visibility} repo {plan.repo_id} @ {plan.revision} in one "
                  f"commit: {plan.commit_message!r}")
    for name, size in plan.files:
        console.print(f"  {name:<24} {size:>14,} bytes")
    if dry_run:
        return
    url = hub_push.push(plan, token)
    console.print(f"pushed: {url}")
    typer.echo(url)


push.__doc__ = (push.__doc__ or "") + example(EXAMPLE)
