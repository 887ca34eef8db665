#!/bin/sh
# Description: runs model_hf_interop.py (mlens loader vs Hugging Face
# transformers); skips where python3 is absent.
command -v python3 >/dev/null 2>&1 || { echo "SKIP: no python3"; exit 77; }
exec python3 "${MLENS_SRCDIR:-.}/tests/model_hf_interop.py"
