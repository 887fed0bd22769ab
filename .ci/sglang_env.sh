#!/usr/bin/env bash
# Create (once) the separate SGLang environment used by the `sglang` tests. SGLang pins its own
# torch, so it never shares the rlx test environment. Cached by path: later runs reuse it.
set -euo pipefail
SGLANG_VERSION=0.5.23
VENV="${RLX_SGLANG_VENV:-$HOME/.cache/rlx/sglang-$SGLANG_VERSION}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import sglang" 2>/dev/null; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "sglang==$SGLANG_VERSION"
fi
echo "$VENV/bin/python"
