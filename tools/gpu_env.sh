#!/usr/bin/env bash
# Sourced by tools/gpu_smoke.sh and tools/gpu_newcomer.sh: on a CUDA machine without network,
# installs the wheels in .whl/ (see docs/internals.md) into /tmp/site once and puts it and the
# checkout on PYTHONPATH; without .whl/, only the checkout.
if compgen -G ".whl/*.whl" > /dev/null; then
    if [ ! -f /tmp/site/.installed ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        # pure-Python packages published without a wheel (cellpylib, zss): copied as folders
        [ -d .whl/site ] && cp -r .whl/site/. /tmp/site/
        # reasoning-gym imports pycosat for one task family; no wheel for it: a stub module
        [ -f /tmp/site/pycosat.py ] || python3 -c "import pycosat" 2>/dev/null \
            || echo '"""stub: no SAT tasks here"""' > /tmp/site/pycosat.py
        # compiled now, warnings off: an old package's SyntaxWarning must not fail the tests
        python3 -W ignore -m compileall -q /tmp/site > /dev/null
        touch /tmp/site/.installed
    fi
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
