# shellcheck shell=bash
# Sourced by tools/py39_check.sh and tools/device_check.sh: a Debian root filesystem built
# once with debootstrap and cached (~/.cache/fedbit/<arch>-<suite>), entered with chroot,
# with the wheel built on the host installed in a venv inside it. Needs root.
#
#   rootfs_tools ARCH                  debootstrap (+ qemu-user-static, binfmt for arm64)
#   rootfs_build ROOT ARCH SUITE PKGS  debootstrap unless ROOT was built with these
#   rootfs_enter ROOT                  bind /proc, /sys, /dev (undone by rootfs_leave)
#   inside ROOT CMD...                 run CMD in ROOT with a clean environment
#   rootfs_wheel PY                    build dist/fedbit-*.whl on the host; prints its path
#   rootfs_venv ROOT VENV WHEEL EXTRAS [CONSTRAINTS]
#                                      a venv with the wheel (kept while its requirements
#                                      and constraints are the same: then only fedbit is
#                                      reinstalled), pip's -c CONSTRAINTS when given

ROOTFS_MOUNTS=()

rootfs_say() { echo "${ROOTFS_TAG:-rootfs}: $*" >&2; }

rootfs_tools() {
    [ "$(id -u)" = 0 ] || { rootfs_say "needs root (debootstrap, chroot)"; return 1; }
    local need=""
    command -v debootstrap >/dev/null || need="$need debootstrap"
    if [ "$1" = arm64 ] && [ "$(uname -m)" != aarch64 ]; then
        [ -x /usr/bin/qemu-aarch64-static ] || need="$need qemu-user-static"
        command -v update-binfmts >/dev/null || need="$need binfmt-support"
    fi
    if [ -n "$need" ]; then
        rootfs_say "installing$need"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        # shellcheck disable=SC2086
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need >/dev/null
    fi
}

rootfs_build() {
    local root=$1 arch=$2 suite=$3 pkgs=$4 t0
    local want="$arch $suite $pkgs" marker="$1/.fedbit-rootfs-done"
    if [ "${FEDBIT_ROOTFS_FRESH:-0}" != 1 ] && [ -f "$marker" ]; then
        # an empty marker: made by an older device_check.sh with the same packages
        if [ ! -s "$marker" ] || [ "$(cat "$marker")" = "$want" ]; then return 0; fi
    fi
    t0=$(date +%s)
    rootfs_say "debootstrap $arch $suite into $root (once; minutes)"
    rootfs_leave
    rm -rf "$root"; mkdir -p "$root"
    debootstrap --arch="$arch" --variant=minbase --include="$pkgs" "$suite" "$root" \
        http://deb.debian.org/debian >"$root.debootstrap.log" 2>&1 \
        || { tail -20 "$root.debootstrap.log" >&2; return 1; }
    echo "$want" > "$marker"
    rootfs_say "root filesystem in $(( $(date +%s) - t0 )) s"
}

rootfs_enter() {
    local root=$1 m
    for m in proc sys dev; do
        mkdir -p "$root/$m"
        mountpoint -q "$root/$m" || { mount --bind "/$m" "$root/$m"; ROOTFS_MOUNTS+=("$root/$m"); }
    done
    # a TLS-intercepting proxy's CA, if the host trusts one (pip inside uses it)
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/host-ca.crt"
    cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
}

rootfs_leave() {
    local m
    for m in "${ROOTFS_MOUNTS[@]}"; do umount -l "$m" 2>/dev/null || true; done
    ROOTFS_MOUNTS=()
}

inside() {  # a clean environment: no host pip settings or venv leak in
    local root=$1; shift
    chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin \
        LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
        PIP_DEFAULT_TIMEOUT=180 ${ROOTFS_ENV:-} "$@"
}

rootfs_wheel() {
    local py=$1 repo
    repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    rm -rf "$repo/dist"
    "$py" -m build --no-isolation --wheel --outdir "$repo/dist" "$repo" >/dev/null 2>&1 \
        || { "$py" -m build --no-isolation --wheel --outdir "$repo/dist" "$repo" | tail -20 >&2; return 1; }
    ls "$repo"/dist/fedbit-*-py3-none-any.whl
}

# the wheel's requirements (Requires-Python, Requires-Dist), the extras asked for and the
# constraints file's text: what decides whether a venv can be kept
_wheel_requirements() {
    "$2" - "$1" "$3" "${4:-}" <<'PYEOF'
import hashlib, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
req = [ln for ln in meta.splitlines() if ln.startswith(("Requires-Dist:", "Requires-Python:"))]
pins = open(sys.argv[3]).read() if sys.argv[3] else ""
print(hashlib.sha256("\n".join(req + [sys.argv[2], pins]).encode()).hexdigest()[:16])
PYEOF
}

rootfs_venv() {
    local root=$1 venv=$2 whl=$3 extras=$4 constraints=${5:-} key t0 w pin=()
    key=$(_wheel_requirements "$whl" "${PY:-python3}" "$extras" "$constraints")
    cp "$whl" "$root/root/"
    w=/root/$(basename "$whl")
    if [ -n "$constraints" ]; then
        cp "$constraints" "$root/root/constraints.txt"
        pin=(-c /root/constraints.txt)
    fi
    t0=$(date +%s)
    if [ "${FEDBIT_ROOTFS_FRESH_VENV:-0}" != 1 ] && [ "$(cat "$root$venv/.fedbit-requirements" 2>/dev/null)" = "$key" ]; then
        inside "$root" "$venv/bin/pip" install -q --no-deps --force-reinstall "$w"
        rootfs_say "venv $venv kept (same requirements), fedbit reinstalled in $(( $(date +%s) - t0 )) s"
    else
        inside "$root" rm -rf "$venv"
        inside "$root" python3 -m venv "$venv"
        # --only-binary: every dependency must have a wheel for this Python and machine
        inside "$root" "$venv/bin/pip" install -q --only-binary :all: "${pin[@]}" "$w[$extras]"
        echo "$key" > "$root$venv/.fedbit-requirements"
        rootfs_say "venv $venv with $(basename "$whl")[$extras] in $(( $(date +%s) - t0 )) s," \
            "$(du -sm "$root$venv" | cut -f1) MB"
    fi
}
