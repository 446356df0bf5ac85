#!/usr/bin/env bash
# make device-check: fedbit on 64-bit ARM without the hardware (issue 15).
#
# Builds (once, then cached) an arm64 Debian bookworm root filesystem, which is what
# Raspberry Pi OS 64-bit and the Jetson images stand for, with debootstrap, and runs it
# under qemu-user-static through binfmt_misc. Inside it: install the wheel exactly as
# docs/device.md says (a venv, `pip install <wheel>` then `[data]`; no torch), check that
# edge_client starts without warnings and without torch, warm the kernels, measure Int8
# training of fedshift_cnn (samples/s, peak RSS), then run `fedbit-edge run` (Int8
# digits_cnn, kmeans-4 uplink) against a `fedbit serve` on the host over loopback MQTT,
# which must count its update. The last line says what passed.
#
# Needs root and apt (debootstrap, qemu-user-static, binfmt-support are installed when
# missing). binfmt's state is restored on exit. Cache: FEDBIT_ARM64_ROOT (default
# ~/.cache/fedbit/arm64-bookworm); FEDBIT_ARM64_FRESH=1 rebuilds it.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PY:-$REPO/.venv/bin/python}
case "$PY" in /*) ;; *) PY="$REPO/$PY" ;; esac   # absolute, but not resolved: it is a venv's
ROOT=${FEDBIT_ARM64_ROOT:-$HOME/.cache/fedbit/arm64-bookworm}
OUT=${FEDBIT_DEVICE_CHECK_OUT:-$REPO/runs/device-check}
export PATH="$PATH:/usr/sbin:/sbin"
passed=()
say() { echo "device-check: $*" >&2; }
elapsed() { echo $(( $(date +%s) - $1 )); }

[ "$(id -u)" = 0 ] || { say "needs root (debootstrap, chroot, binfmt_misc)"; exit 1; }
need=""
command -v debootstrap >/dev/null || need="$need debootstrap"
[ -x /usr/bin/qemu-aarch64-static ] || need="$need qemu-user-static"
command -v update-binfmts >/dev/null || need="$need binfmt-support"
if [ -n "$need" ]; then
    say "installing$need"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need >/dev/null
fi

# binfmt: on before chrooting (without it only the first process is emulated, and pip
# and dpkg fail); back to how it was on exit
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
was_enabled=0
[ -f /proc/sys/fs/binfmt_misc/qemu-aarch64 ] && grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64 && was_enabled=1
mounted=()
cleanup() {
    for m in "${mounted[@]}"; do umount -l "$m" 2>/dev/null || true; done
    if [ "$was_enabled" = 0 ]; then update-binfmts --disable qemu-aarch64 2>/dev/null || true; fi
    [ -n "${SERVE_PID:-}" ] && kill "$SERVE_PID" 2>/dev/null || true
}
trap cleanup EXIT
update-binfmts --enable qemu-aarch64 || update-binfmts --import qemu-aarch64
passed+=("binfmt")

if [ "${FEDBIT_ARM64_FRESH:-0}" = 1 ]; then rm -rf "$ROOT"; fi
if [ ! -f "$ROOT/.fedbit-rootfs-done" ]; then
    t0=$(date +%s)
    say "debootstrap arm64 bookworm into $ROOT (once; several minutes)"
    rm -rf "$ROOT"; mkdir -p "$ROOT"
    debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$ROOT" http://deb.debian.org/debian >"$ROOT.debootstrap.log" 2>&1 \
        || { tail -20 "$ROOT.debootstrap.log"; exit 1; }
    touch "$ROOT/.fedbit-rootfs-done"
    say "root filesystem in $(elapsed "$t0") s"
fi
passed+=("arm64 rootfs")
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/host-ca.crt"   # a proxy's CA, if any
for m in proc sys dev; do mkdir -p "$ROOT/$m"; mount --bind "/$m" "$ROOT/$m"; mounted+=("$ROOT/$m"); done
# shellcheck disable=SC2317
inside() {  # a clean environment: no host pip settings leak in
    chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
        PIP_CERT=/etc/ssl/certs/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 "$@"
}
[ "$(inside uname -m)" = aarch64 ] || { say "the chroot is not aarch64"; exit 1; }

# the wheel, built on the host as docs/device.md says (make wheel)
rm -rf "$REPO/dist"; "$PY" -m build --no-isolation --outdir "$REPO/dist" "$REPO" >/dev/null
whl=$(ls "$REPO"/dist/fedbit-*-py3-none-any.whl)
cp "$whl" "$ROOT/root/"
w=/root/$(basename "$whl")
# the wheel's RECORD (file hashes, no timestamps) says whether the installed venv is this
# wheel's; a venv of the same wheel is kept (with its numba cache: the first compile under
# qemu takes minutes), FEDBIT_ARM64_FRESH_VENV=1 reinstalls anyway
record=$("$PY" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); print(z.read(next(n for n in z.namelist() if n.endswith('.dist-info/RECORD'))).decode())" "$whl" | sha256sum | cut -c1-16)
if [ "${FEDBIT_ARM64_FRESH_VENV:-0}" = 1 ] || [ "$(cat "$ROOT/root/fedbit/.fedbit-wheel" 2>/dev/null)" != "$record" ]; then
    t0=$(date +%s)
    inside rm -rf /root/fedbit
    inside python3 -m venv /root/fedbit
    inside /root/fedbit/bin/pip install -q "$w"
    inside /root/fedbit/bin/pip install -q "$w[data]"
    install_s=$(elapsed "$t0")
    echo "$record" > "$ROOT/root/fedbit/.fedbit-wheel"
    venv_mb=$(du -sm "$ROOT/root/fedbit" | cut -f1)
    say "wheel installed in ${install_s} s, venv ${venv_mb} MB"
    passed+=("README install of the wheel (${install_s} s, ${venv_mb} MB)")
else
    say "the venv holds this wheel already (FEDBIT_ARM64_FRESH_VENV=1 reinstalls)"
fi
if inside /root/fedbit/bin/python -c "import torch" 2>/dev/null; then say "torch got installed"; exit 1; fi
passed+=("no torch")
inside /root/fedbit/bin/fedbit-edge --version
inside /root/fedbit/bin/python -W error -c "import edge_client.codecs, edge_client.runtime, edge_client.trainers, sys; assert 'torch' not in sys.modules"
passed+=("imports without warnings or torch")

t0=$(date +%s)
inside /root/fedbit/bin/fedbit-edge warmup --profile raspberry-pi-4 --model digits_cnn
warm_s=$(elapsed "$t0")
t0=$(date +%s)
inside /root/fedbit/bin/fedbit-edge warmup --profile raspberry-pi-4 --model digits_cnn
warm2_s=$(elapsed "$t0")
passed+=("warmup (first ${warm_s} s, cached ${warm2_s} s)")

cat > "$ROOT/root/train_probe.py" <<'PYEOF'
import json, resource, sys, time
import numpy as np
from edge_client.data import Dataset
from edge_client.trainers import IntTrainer
from firmware_models import get_spec
name, steps = sys.argv[1], int(sys.argv[2])
spec = get_spec(name)
rng = np.random.default_rng(0)
x = rng.random((256, *spec.input_shape), dtype=np.float32)
d = Dataset(x, rng.integers(0, spec.num_classes, 256).astype(np.int64))
tr = IntTrainer(spec, 8, seed=0)
t0 = time.perf_counter(); tr.train(d, steps=1, batch=32); first = time.perf_counter() - t0
t0 = time.perf_counter(); tr.train(d, steps=steps, batch=32); dt = time.perf_counter() - t0
print(json.dumps({"model": name, "samples_per_s": steps * 32 / dt, "first_step_s": first,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
PYEOF
arm=$(inside /root/fedbit/bin/python /root/train_probe.py fedshift_cnn 3 | tail -1)
native=$(cd /tmp && NUMBA_NUM_THREADS=1 "$PY" "$ROOT/root/train_probe.py" fedshift_cnn 20 | tail -1)
say "Int8 fedshift_cnn under qemu: $arm"
say "Int8 fedshift_cnn native:     $native"
# qemu-user's RSS includes its own translated-code cache: the same imports without
# training, under qemu and natively, show how much of it is the emulator's
base='import resource, numpy, numba, edge_client.trainers; print(round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))'
base_arm=$(inside /root/fedbit/bin/python -c "$base" | tail -1)
base_native=$(cd /tmp && "$PY" -c "$base" | tail -1)
rss=$(echo "$arm" | "$PY" -c "import json,sys; print(round(json.load(sys.stdin)['peak_rss_mb']))")
rss_native=$(echo "$native" | "$PY" -c "import json,sys; print(round(json.load(sys.stdin)['peak_rss_mb']))")
say "peak RSS: ${rss} MB under qemu (imports alone ${base_arm} MB), ${rss_native} MB native (imports alone ${base_native} MB)"
[ "$rss_native" -le 200 ] || { say "peak RSS ${rss_native} MB over the 200 MB budget"; exit 1; }
passed+=("Int8 fedshift_cnn training (${rss} MB under qemu incl. the emulator, ${rss_native} MB native <= 200)")

mkdir -p "$OUT"; rm -rf "$OUT/serve"
port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
"$REPO/.venv/bin/fedbit" serve --model digits_cnn --rounds 1 --min-devices 1 --port "$port" \
    --out "$OUT/serve" --steps 5 --round-timeout 900 --presence-timeout 600 --quiet >"$OUT/serve.log" 2>&1 &
SERVE_PID=$!
sleep 5
inside /root/fedbit/bin/fedbit-edge run --broker "mqtt://127.0.0.1:$port" --id arm64-pi --profile raspberry-pi-4 \
    --data digits:1/4 --codec kmeans --codec-bits 4 --workdir /root/dev --max-seconds 900 >"$OUT/device.log" 2>&1
wait "$SERVE_PID"; SERVE_PID=
grep -q '"accepted_ids": \["arm64-pi"\]' "$OUT/serve/metrics.jsonl" \
    || { say "the coordinator did not count the arm64 device's update"; tail -5 "$OUT/serve.log"; exit 1; }
passed+=("an arm64 device's Int8 kmeans-4 update counted by the host's coordinator")
echo "device-check passed: $(IFS=';'; echo "${passed[*]}")"
