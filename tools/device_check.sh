#!/usr/bin/env bash
# make device-check: fedbit on 64-bit ARM without the hardware (issues 15 and 24).
#
# Builds (once, then cached) arm64 Debian root filesystems with debootstrap and runs them
# under qemu-user-static through binfmt_misc: bookworm (Python 3.11: Raspberry Pi OS
# bookworm) and bullseye (Python 3.9: Raspberry Pi OS bullseye; JetPack 5 with python3.9
# stands for the same floor). In each: install the wheel as docs/device.md says (a venv,
# `pip install <wheel>[data]`, every dependency from a wheel; no torch), check that
# edge_client starts without warnings and without torch, that doctor passes the Python
# check, warm the kernels, measure Int8 training of fedshift_cnn (samples/s, peak RSS),
# then run `fedbit-edge run` (Int8 digits_cnn, kmeans-4 uplink) against a `fedbit serve`
# on the host over loopback MQTT, which must count its update. The last line says what
# passed.
#
# Needs root and apt (debootstrap, qemu-user-static, binfmt-support are installed when
# missing). binfmt's state is restored on exit. Slow (the first compile under qemu takes
# minutes; ~20 minutes a suite the first time); not part of .ci/run (tools/py39_check.sh
# is: bullseye natively on x86_64). FEDBIT_ARM64_SUITES ("bookworm bullseye") picks the
# suites; caches under FEDBIT_CACHE (~/.cache/fedbit)/arm64-<suite>; FEDBIT_ROOTFS_FRESH=1
# rebuilds them, FEDBIT_ROOTFS_FRESH_VENV=1 only the venvs.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PY:-$REPO/.venv/bin/python}
case "$PY" in /*) ;; *) PY="$REPO/$PY" ;; esac   # absolute, but not resolved: it is a venv's
CACHE=${FEDBIT_CACHE:-$HOME/.cache/fedbit}
SUITES=${FEDBIT_ARM64_SUITES:-bookworm bullseye}
OUT=${FEDBIT_DEVICE_CHECK_OUT:-$REPO/runs/device-check}
ROOTFS_TAG=device-check
# shellcheck source=tools/rootfs.sh
. "$REPO/tools/rootfs.sh"
export PATH="$PATH:/usr/sbin:/sbin"
passed=()
say() { rootfs_say "$*"; }
elapsed() { echo $(( $(date +%s) - $1 )); }

rootfs_tools arm64
# binfmt: on before chrooting (without it only the first process is emulated, and pip
# and dpkg fail); back to how it was on exit
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
was_enabled=0
[ -f /proc/sys/fs/binfmt_misc/qemu-aarch64 ] && grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64 && was_enabled=1
SERVE_PID=
cleanup() {
    rootfs_leave
    if [ "$was_enabled" = 0 ]; then update-binfmts --disable qemu-aarch64 2>/dev/null || true; fi
    if [ -n "$SERVE_PID" ]; then kill "$SERVE_PID" 2>/dev/null || true; fi
}
trap cleanup EXIT
update-binfmts --enable qemu-aarch64 || update-binfmts --import qemu-aarch64
passed+=("binfmt")

# the wheel, built on the host as docs/device.md says (make wheel)
whl=$(rootfs_wheel "$PY")
native=$(cd /tmp && NUMBA_NUM_THREADS=1 "$PY" "$REPO/tools/train_probe.py" fedshift_cnn 20 | tail -1)
say "Int8 fedshift_cnn native: $native"
rss_native=$(echo "$native" | "$PY" -c "import json,sys; print(round(json.load(sys.stdin)['peak_rss_mb']))")
[ "$rss_native" -le 200 ] || { say "peak RSS ${rss_native} MB over the 200 MB budget"; exit 1; }
# qemu-user's RSS includes its own translated-code cache: the same imports without
# training, under qemu and natively, show how much of it is the emulator's
base='import resource, numpy, numba, edge_client.trainers; print(round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))'
base_native=$(cd /tmp && "$PY" -c "$base" | tail -1)

check_suite() {
    local suite=$1 root="$CACHE/arm64-$1" v=/root/fedbit t0 pyver warm_s warm2_s arm base_arm rss port
    local id="arm64-$1"
    rootfs_build "$root" arm64 "$suite" python3,python3-venv,python3-pip,ca-certificates
    rootfs_enter "$root"
    [ "$(inside "$root" uname -m)" = aarch64 ] || { say "the $suite chroot is not aarch64"; exit 1; }
    pyver=$(inside "$root" python3 -c 'import platform; print(platform.python_version())')
    passed+=("arm64 $suite rootfs (Python $pyver)")

    t0=$(date +%s)
    rootfs_venv "$root" "$v" "$whl" data
    passed+=("$suite: docs/device.md's install of the wheel, wheels only ($(elapsed "$t0") s)")
    if inside "$root" "$v/bin/python" -c "import torch" 2>/dev/null; then say "$suite: torch got installed"; exit 1; fi
    inside "$root" "$v/bin/fedbit-edge" --version
    inside "$root" "$v/bin/python" -W error -c "import edge_client.codecs, edge_client.runtime, edge_client.trainers, sys; assert 'torch' not in sys.modules"
    # (the whole output first: grep -q on a pipe may close it under doctor, which then fails)
    inside "$root" "$v/bin/fedbit-edge" doctor --profile raspberry-pi-4 > "$OUT/doctor-$suite.txt" || true
    grep -q "^PASS  python: $pyver" "$OUT/doctor-$suite.txt" \
        || { cat "$OUT/doctor-$suite.txt"; say "$suite: doctor's python check"; exit 1; }
    passed+=("$suite: imports without warnings or torch, doctor's python check passes")

    t0=$(date +%s)
    inside "$root" "$v/bin/fedbit-edge" warmup --profile raspberry-pi-4 --model digits_cnn
    warm_s=$(elapsed "$t0")
    t0=$(date +%s)
    inside "$root" "$v/bin/fedbit-edge" warmup --profile raspberry-pi-4 --model digits_cnn
    warm2_s=$(elapsed "$t0")
    passed+=("$suite: warmup (first ${warm_s} s, cached ${warm2_s} s)")

    cp "$REPO/tools/train_probe.py" "$root/root/train_probe.py"
    arm=$(inside "$root" "$v/bin/python" /root/train_probe.py fedshift_cnn 3 | tail -1)
    say "$suite: Int8 fedshift_cnn under qemu: $arm"
    base_arm=$(inside "$root" "$v/bin/python" -c "$base" | tail -1)
    rss=$(echo "$arm" | "$PY" -c "import json,sys; print(round(json.load(sys.stdin)['peak_rss_mb']))")
    say "$suite: peak RSS ${rss} MB under qemu (imports alone ${base_arm} MB), ${rss_native} MB native (imports alone ${base_native} MB)"
    passed+=("$suite: Int8 fedshift_cnn training (${rss} MB under qemu incl. the emulator, ${rss_native} MB native <= 200)")

    rm -rf "$OUT/serve-$suite"
    port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
    "$REPO/.venv/bin/fedbit" serve --model digits_cnn --rounds 1 --min-devices 1 --port "$port" \
        --out "$OUT/serve-$suite" --steps 5 --round-timeout 900 --presence-timeout 600 --quiet >"$OUT/serve-$suite.log" 2>&1 &
    SERVE_PID=$!
    sleep 5
    inside "$root" "$v/bin/fedbit-edge" run --broker "mqtt://127.0.0.1:$port" --id "$id" --profile raspberry-pi-4 \
        --data digits:1/4 --codec kmeans --codec-bits 4 --workdir /root/dev --max-seconds 900 >"$OUT/device-$suite.log" 2>&1
    wait "$SERVE_PID"; SERVE_PID=
    grep -q "\"accepted_ids\": \[\"$id\"\]" "$OUT/serve-$suite/metrics.jsonl" \
        || { say "the coordinator did not count the $suite device's update"; tail -5 "$OUT/serve-$suite.log"; exit 1; }
    passed+=("$suite: an arm64 device's Int8 kmeans-4 update counted by the host's coordinator")
    rootfs_leave
}

mkdir -p "$OUT"
for suite in $SUITES; do
    check_suite "$suite"
done
echo "device-check passed: $(IFS=';'; echo "${passed[*]}")"
