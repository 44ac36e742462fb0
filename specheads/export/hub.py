"""Uploading an export to the Hugging Face Hub: where each layout goes, and the upload itself.

    destinations = hub_destinations("acme/head-{engine}", ("vllm", "sglang"), nested=True)
    push_export(Path("runs/x/export"), destinations, nested=True, method="eagle3")
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from specheads.export.checks import ExportError

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a hub repo id: owner/name


def check_repo_id(repo_id: str) -> None:
    """Fail before any work on a ``push_to_hub`` that is not ``owner/name`` or ``owner/name-{engine}``."""
    plain = (repo_id or "").replace("{engine}", "x")
    if not HUB_ID.fullmatch(plain) or "{" in plain or "}" in plain:
        raise ExportError(f"push_to_hub must be a repo id 'owner/name' (or 'owner/name-{{engine}}', one repo per "
                          f"layout), got {repo_id!r}")


def hub_destinations(repo_spec: str, engines: tuple[str, ...], nested: bool) -> dict[str, tuple[str, str | None]]:
    """{engine: (repo id, folder in the repo or None)}: ``owner/name-{engine}`` gives each layout its own
    repo (what ``vllm serve`` / SGLang can name directly); a plain ``owner/name`` holds one layout at its root,
    or several, each in its own subfolder (``vllm/``, ``sglang/``, ...: download, then serve the folder)."""
    if "{engine}" in repo_spec:
        return {e: (repo_spec.replace("{engine}", e), None) for e in engines}
    return {e: (repo_spec, e if nested else None) for e in engines}


def push_export(out: Path, destinations: dict[str, tuple[str, str | None]], nested: bool, method: str,
                private: bool = True, dry_run: bool = False, api=None) -> list:
    """Upload each layout exported in ``out`` (``out/<engine>`` when ``nested``) to its destination
    (``hub_destinations``); returns the uploads ``[(repo id, folder in repo, local folder, [files])]``. The token
    comes from ``HF_TOKEN`` or the ``huggingface_hub`` login and is never printed; repos are created private
    unless ``private=False``; ``dry_run`` prints the uploads and touches nothing."""
    uploads = []
    for e, (repo_id, path_in_repo) in destinations.items():
        local = out / e if nested else out
        files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
        uploads.append((repo_id, path_in_repo, local, files))
    if dry_run:
        for repo_id, path_in_repo, local, files in uploads:
            size = sum((local / f).stat().st_size for f in files)
            print(f"would upload {local} -> {repo_id}" + (f" (folder {path_in_repo}/)" if path_in_repo else "")
                  + f", {'private' if private else 'public'}: {len(files)} files, {size / 1e6:.1f} MB")
            for f in files:
                print(f"  {(path_in_repo + '/') if path_in_repo else ''}{f}")
        return uploads
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()  # token: HF_TOKEN or the stored login; never passed through our logs
    for repo_id in dict.fromkeys(u[0] for u in uploads):
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    for repo_id, path_in_repo, local, _ in uploads:
        api.upload_folder(repo_id=repo_id, folder_path=str(local), path_in_repo=path_in_repo, repo_type="model",
                          commit_message=f"specheads export ({method}, {local.name if nested else 'layout'})")
        log.info("pushed %s to %s%s", local, repo_id, f"/{path_in_repo}" if path_in_repo else "")
    return uploads
