"""`polybasic push`: upload a chain bundle to the Hugging Face Hub."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("push", help="upload a chain bundle to the Hugging Face Hub",
                       description="Create the Hub model repository REPO_ID (if needed) and upload the bundle "
                                   "folder with its model card. Authenticate with `hf auth login` or HF_TOKEN.")
    p.add_argument("bundle", metavar="BUNDLE", help="the bundle folder (`polybasic export` / `polybasic run`)")
    p.add_argument("repo_id", metavar="REPO_ID", help="owner/name on the Hub")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.set_defaults(func=_cmd_push)


def _cmd_push(a: argparse.Namespace) -> int:
    from polybasic.runtime.bundle import check_bundle  # start-up time: torch only when it runs
    from polybasic.runtime.hub import push_bundle

    check_bundle(a.bundle, verify_target=False)  # a broken bundle is never uploaded
    print(push_bundle(a.bundle, a.repo_id, private=a.private))
    return 0
