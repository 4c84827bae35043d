#!/usr/bin/env bash
# Run tests/engines/test_cuda.py on a machine with CUDA (CI has none; the file skips itself there).
#
#   bash tests/engines/cuda_check.sh [pytest options]          e.g.  bash tests/engines/cuda_check.sh -q -x
#   DNNSAFETY_SYNC_DEBUG=warn bash tests/engines/cuda_check.sh  list every host sync of a loop, not just the first
#   DNNSAFETY_EVIDENCE_DIR=dir bash tests/engines/cuda_check.sh keep the example project's evidence files
#
# example_project's model and data are generated (git-ignored): they are made here when missing.
#
# The plugin must be importable in the subprocess that runs example_project: an editable install
# when pip can make one offline (setuptools present), else PYTHONPATH (the test then adds
# -p pytest_dnnsafety.plugin.hooks itself).
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
has_entry_point() {
  "$PY" - <<'PYEOF' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if any(e.value == "pytest_dnnsafety.plugin.hooks" for e in m.entry_points(group="pytest11")) else 1)
PYEOF
}
if ! has_entry_point; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
  has_entry_point || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ ! -f example_project/models/digits_cnn.pt ] || [ ! -f example_project/data/eval.npz ]; then
  (cd example_project && "$PY" -m digits_demo.train) || echo "example_project: training failed; its test will skip"
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
           torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
exec "$PY" -m pytest tests/engines/test_cuda.py -p no:cacheprovider -rfEXx "$@"
