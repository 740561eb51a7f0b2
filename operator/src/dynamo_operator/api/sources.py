"""Where weights come from: the URI forms a worker can download, as CEL rules with Python mirrors.

The worker's downloader takes `s3://bucket/prefix`, `hf://org/repo[@revision]` and
`file:///absolute/path`. Credentials never go into a URI: a URI is shown in status, events and
logs, so the rules refuse a userinfo part and point at the Secret references instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from dynamo_operator.api.base import Rule
from dynamo_operator.api.common import cel_string

URI_MAX_LENGTH = 2048
SCHEMES = ("s3://", "hf://", "file://")
S3_URI_PATTERN = r"^s3://[A-Za-z0-9][A-Za-z0-9._-]*(/.*)?$"
# A repository id with an optional owner, then an optional revision (which may hold `/`,
# as in `refs/pr/7`).
HF_URI_PATTERN = r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?(@[A-Za-z0-9][A-Za-z0-9._/-]*)?$"
FILE_URI_PATTERN = r"^file:///[^/]"
# `user:password@host`: a userinfo part with a password, in any scheme.
USERINFO_WITH_PASSWORD_PATTERN = r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@]*:[^/@]*@"
# `s3://key@bucket`: any userinfo where the authority is a bucket or a host. (`hf://gpt2@main`
# is a repository at a revision, so hf:// URIs are checked only for the password form.)
USERINFO_PATTERN = r"^(s3|file)://[^/]*@"


def _matches(pattern: str) -> Callable[[str], bool]:
    """CEL `matches` (an RE2 search) in Python; our patterns read the same in both."""
    compiled = re.compile(pattern)
    return lambda value: compiled.search(value) is not None


_s3, _hf, _file = _matches(S3_URI_PATTERN), _matches(HF_URI_PATTERN), _matches(FILE_URI_PATTERN)
_password, _userinfo = _matches(USERINFO_WITH_PASSWORD_PATTERN), _matches(USERINFO_PATTERN)


def uri_rules(
    attribute: str,
    path: str,
    get: Callable[[Any], str | None],
    *,
    allow_local_path: bool = False,
) -> tuple[Rule, ...]:
    """Rules for the source URI held in `attribute` (camelCase) of an object.

    `path` is the field as users know it (`spec.source.uri`) and starts every message; `get`
    reads the value from the Python model (None: the field is unset, nothing to check).
    `allow_local_path` also accepts an absolute path inside the pod (base model weights baked
    into the image or on a volume).
    """
    value = f"self.{attribute}"
    guard = f"!has(self.{attribute}) || "
    field_path = f".{attribute}"

    def holds(test: Callable[[str], bool]) -> Callable[[Any], bool]:
        def check(obj: Any) -> bool:
            uri = get(obj)
            return uri is None or test(uri)

        return check

    schemes = " || ".join(f"{value}.startsWith({cel_string(s)})" for s in SCHEMES)
    scheme_message = f"{path}: use s3://, hf:// or file://"
    if allow_local_path:
        schemes = f"{value}.startsWith('/') || {schemes}"
        scheme_message = f"{path}: use an absolute path in the pod, s3://, hf:// or file://"

    def known_scheme(uri: str) -> bool:
        return uri.startswith(SCHEMES) or (allow_local_path and uri.startswith("/"))

    return (
        Rule(
            rule=guard + f"({schemes})",
            message=scheme_message,
            check=holds(known_scheme),
            field_path=field_path,
        ),
        Rule(
            rule=guard
            + f"(!{value}.matches({cel_string(USERINFO_WITH_PASSWORD_PATTERN)})"
            + f" && !{value}.matches({cel_string(USERINFO_PATTERN)}))",
            message=f"{path} must not contain credentials (user:password@); "
            "reference a Secret on the DynamoWorker instead (spec.credentials)",
            check=holds(lambda uri: not _password(uri) and not _userinfo(uri)),
            field_path=field_path,
        ),
        Rule(
            rule=guard
            + f"!{value}.startsWith('s3://') || {value}.matches({cel_string(S3_URI_PATTERN)})",
            message=f"{path}: s3:// URIs take the form s3://bucket/prefix",
            check=holds(lambda uri: not uri.startswith("s3://") or _s3(uri)),
            field_path=field_path,
        ),
        Rule(
            rule=guard
            + f"!{value}.startsWith('hf://') || {value}.matches({cel_string(HF_URI_PATTERN)})",
            message=f"{path}: hf:// URIs take the form hf://org/repo or hf://org/repo@revision",
            check=holds(lambda uri: not uri.startswith("hf://") or _hf(uri)),
            field_path=field_path,
        ),
        Rule(
            rule=guard
            + f"!{value}.startsWith('file://') || {value}.matches({cel_string(FILE_URI_PATTERN)})",
            message=f"{path}: file:// URIs take an absolute path, file:///path/in/the/pod",
            check=holds(lambda uri: not uri.startswith("file://") or _file(uri)),
            field_path=field_path,
        ),
    )
