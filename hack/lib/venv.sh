# Sourced by hack/* and .ci/run: makes sure the project's venv exists with the dev extras.
# Sets PY to its python. pip keeps downloaded wheels in its cache, so a re-create is quick.
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${DYNAMO_VENV:-$REPO_DIR/.venv}"
PY="$VENV/bin/python"
_stamp="$VENV/.installed-$(sha256sum "$REPO_DIR/pyproject.toml" | cut -c1-16)"
if [[ ! -f "$_stamp" ]]; then
  echo "[venv] installing the project with its dev extras into $VENV (cold: 5-10 min, torch is large)" >&2
  [[ -x "$PY" ]] || python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip >&2
  "$PY" -m pip install -q -e "$REPO_DIR[dev]" >&2
  rm -f "$VENV"/.installed-*
  touch "$_stamp"
fi
