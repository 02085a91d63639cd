#!/usr/bin/env bash
# On the lent GPU machine, from the repository root: install what `python -m bench.gpu_pd_prepare`
# made ready (carried in .gpu_pd/callN), put SmolLM2's GGUF back together, and run the benchmark.
#
#   bash bench/gpu_pd_run.sh stage   # install the wheels and keep this call's GGUF part (calls 1, 2)
#   bash bench/gpu_pd_run.sh run     # the same, then python -m bench.gpu_pd --out $OUT (the last call)
#
# Files kept between the calls of one warm machine live under /tmp/gpu_pd. With the whole GGUF
# there (its size and sha256 as the manifest says), SmolLM2 is served and timed; otherwise the run
# goes on without it (--smollm2 none: bench/gpu_pd_prepare.py says what that measures).
set -euo pipefail
mode=${1:-run}
keep=/tmp/gpu_pd
site=$keep/site
mkdir -p "$keep/parts" "$site"

for call in .gpu_pd/call*; do
    [ -d "$call" ] || continue
    cp -f "$call"/smollm2.gguf.part* "$keep/parts/" 2>/dev/null || true
    if [ -d "$call/wheels" ]; then
        cp -f "$call/manifest.json" "$keep/"
        cp -rf "$call/tokenizer" "$keep/"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "$call"/wheels/*.whl
    fi
done
# transfer/agent.py takes nixl_cu13 when nixl_cu12 is absent, but the bench harness imports nixl_cu12:
# the CUDA 13 build installs as nixl_cu13, so one name stands for the other
if [ -d "$site/nixl_cu13" ] && [ ! -d "$site/nixl_cu12" ]; then
    mkdir -p "$site/nixl_cu12"
    printf '%s\n' "import importlib, sys" \
        "sys.modules[__name__ + '._api'] = _api = importlib.import_module('nixl_cu13._api')" \
        > "$site/nixl_cu12/__init__.py"
fi
ls -l "$keep/parts" "$site" | head -40
[ "$mode" = stage ] && exit 0

export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
smollm2=none
gguf=$keep/$(python3 -c "import json; print(json.load(open('$keep/manifest.json'))['gguf'])")
cat $(ls "$keep"/parts/smollm2.gguf.part* | sort -V) > "$gguf"
if python3 - "$keep/manifest.json" "$gguf" <<'EOF'
import hashlib, json, sys
m = json.load(open(sys.argv[1]))
data = open(sys.argv[2], "rb").read()
sys.exit(0 if len(data) == m["bytes"] and hashlib.sha256(data).hexdigest() == m["sha256"] else 1)
EOF
then
    smollm2=$gguf
else
    echo "SmolLM2's GGUF is incomplete here (parts: $(ls "$keep/parts" | tr '\n' ' ')): running without SmolLM2"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 -m bench.gpu_pd --out "${OUT:-$keep/out}" --smollm2 "$smollm2" --tokenizer "$keep/tokenizer" 2>&1 \
    | tee "${OUT:-$keep/out}/gpu_pd.log"
