#!/usr/bin/env bash
# The shm kernel on aarch64, under emulation (qemu-user): Debian 12's aarch64 Python with
# torch's aarch64 wheel runs the instruction-set tests (tests/test_isa_paths.py: every path
# the emulated CPU has, neon, neon-nobf16 and scalar, against one another and the reference)
# and the bytes of every pattern against the digests recorded on x86
# (tests/test_cross_machine.py). The kernel is compiled by the emulated Python's
# cpp_extension with Debian's aarch64 cross compiler, which runs natively (compiling under
# emulation takes minutes). What this shows: the build, the vector code and the bytes; not
# speed, and not Arm's memory ordering (an x86 host runs the emulated loads and stores in its
# own order: docs/design.md argues the protocol's acquire/release instead).
#
# Installs what it lacks (root): qemu-user, qemu-user-binfmt and g++-aarch64-linux-gnu from
# Debian; registers the aarch64 binfmt handler when none is (ranks are new processes of the
# aarch64 Python). Downloads are cached under the user's cache directory ($ARM_CACHE): the
# Debian arm64 packages unpacked into a tree (not installed: a multiarch install would remove
# the native python3), torch's aarch64 wheel (2.8.0: the last CPU-only one on PyPI) and the
# test tools, installed there with pip --target. .venv (scripts/setup.sh) provides pip and
# ninja. Arguments go to pytest. For time (CI prepares it cold beside the suite, with
# ARM_CHECK_PREPARE=1, then runs it): pip's download runs beside the apt and Debian steps,
# and the kernels of the three instruction sets compile side by side before pytest starts.
#
# ARM_GCC=13 or 14: the kernel compiled by Debian 13's (trixie's) aarch64 cross compiler of
# that version instead of Debian 12's GCC 12 (not in CI: the trixie root is another 700 MB to
# fetch and unpack). Debian 13's compilers need its glibc, so they run in a minimal trixie root
# (debootstrap, installed when missing) under $ARM_CACHE, with the repository, the cache and the
# build directory bound into it at the same paths (a mount namespace per call: nothing to
# unmount). What the kernel links against at run time (libc6, libstdc++6, libgcc-s1, libgomp1)
# is trixie's arm64 build, in a sysroot of its own (built against glibc 2.41's headers, the
# kernel needs glibc 2.38), and its kernels are cached apart (the build key does not name the
# compiler).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
cache=${ARM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/arfuse/aarch64}
torch_version=2.8.0
debs="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11-dev
  python3.11-dev libc6 libstdc++6 libgcc-s1 libgomp1 zlib1g libexpat1 libffi8 libssl3
  libbz2-1.0 liblzma5 libcrypt1 libuuid1"
wheels="torch==$torch_version numpy filelock typing-extensions sympy networkx jinja2 fsspec
  mpmath markupsafe setuptools pytest iniconfig packaging pluggy pygments"
apt_arm=(-o APT::Architectures::=amd64 -o APT::Architectures::=arm64)
gcc=${ARM_GCC:-12}
case $gcc in
  12) sysroot=$cache/sysroot ;;
  13|14) sysroot=$cache/sysroot-gcc$gcc trixie=$cache/trixie
    runtime="libc6 libstdc++6 libgcc-s1 libgomp1"
    debs=$(for deb in $debs; do [[ " $runtime " == *" $deb "* ]] || echo "$deb"; done) ;;
  *) echo "arm_check: ARM_GCC=$gcc: 12 (Debian 12's, the default), 13 or 14 (Debian 13's)" >&2
    exit 2 ;;
esac
site=$cache/site-$torch_version

# torch's wheel, the longest download, comes beside the apt and Debian steps (and goes with
# the script if that stops first)
pip_job=""
if [ ! -e "$site/.done" ]; then
  rm -rf "$site"
  mkdir -p "$cache"
  # shellcheck disable=SC2086
  .venv/bin/pip install -q --no-deps --target "$site" --only-binary=:all: \
    --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 \
    --python-version 3.11 --implementation cp --abi cp311 $wheels >"$cache/pip.log" 2>&1 &
  pip_job=$!
  trap 'kill "$pip_job" 2>/dev/null || true' EXIT
fi

if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-g++ >/dev/null \
    || [ ! -e /usr/lib/binfmt.d/qemu-aarch64.conf ]; then
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    qemu-user qemu-user-binfmt g++-aarch64-linux-gnu >/dev/null
fi
if [ "$gcc" != 12 ] && [ ! -x "$trixie/usr/bin/aarch64-linux-gnu-g++-$gcc" ]; then
  if [ ! -e "$trixie/.done" ]; then
    command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends debootstrap >/dev/null
    rm -rf "$trixie"
    debootstrap --variant=minbase trixie "$trixie" http://deb.debian.org/debian >/dev/null
    touch "$trixie/.done"
  fi
  chroot "$trixie" apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive chroot "$trixie" apt-get install -y -q -o Dpkg::Use-Pty=0 \
    --no-install-recommends "g++-$gcc-aarch64-linux-gnu" >/dev/null
  chroot "$trixie" apt-get clean
fi
binfmt=/proc/sys/fs/binfmt_misc
if [ ! -e $binfmt/register ]; then mount -t binfmt_misc binfmt_misc $binfmt; fi
if [ ! -e $binfmt/qemu-aarch64 ]; then
  cat /usr/lib/binfmt.d/qemu-aarch64.conf >$binfmt/register
fi

if [ ! -e "$sysroot/.done" ]; then
  rm -rf "$sysroot" "$cache/debs"
  mkdir -p "$cache/debs" "$sysroot/proc"
  # apt's lists for arm64 beside the host's (no dpkg --add-architecture: nothing is installed)
  apt-get "${apt_arm[@]}" update -q >/dev/null
  # shellcheck disable=SC2046,SC2086 # one word per package
  (cd "$cache/debs" && apt-get "${apt_arm[@]}" download -qq $(printf '%s:arm64 ' $debs)) 2>&1 \
    | { grep -v "unsandboxed" || true; }
  for deb in "$cache"/debs/*.deb; do dpkg -x "$deb" "$sysroot"; done
  rm -rf "$cache/debs"
  if [ "$gcc" != 12 ]; then
    # trixie's runtime, from its root's apt, put where bookworm's loader and libraries are
    # (trixie's packages put them under /usr/lib; the tree has no merged /usr)
    mkdir -p "$trixie/arm-debs" "$cache/runtime"
    chroot "$trixie" apt-get "${apt_arm[@]}" update -q >/dev/null
    # shellcheck disable=SC2086
    chroot "$trixie" sh -c "cd /arm-debs && apt-get ${apt_arm[*]} download -qq \
      $(printf '%s:arm64 ' $runtime)" 2>&1 | { grep -v "unsandboxed" || true; }
    for deb in "$trixie"/arm-debs/*.deb; do dpkg -x "$deb" "$cache/runtime"; done
    cp -a "$cache/runtime/usr/lib/." "$sysroot/lib/"
    rm -rf "$trixie/arm-debs" "$cache/runtime"
  fi
  # torch's cpuinfo reads /proc/cpuinfo, which qemu shows as the host's (x86: it crashes);
  # qemu looks for an absolute path under its prefix first. These are the features of the
  # CPU qemu emulates by default ("max") that the kernel's build reads: bf16 included.
  for cpu in 0 1; do
    printf 'processor\t: %s\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics %s\n' \
      "$cpu" "fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp asimdfhm i8mm bf16"
    printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU part\t: 0xd4f\n\n'
  done >"$sysroot/proc/cpuinfo"
  touch "$sysroot/.done"
fi
if [ -n "$pip_job" ]; then
  pip_status=0
  wait "$pip_job" || pip_status=$?
  trap - EXIT
  grep -v "is ignored" "$cache/pip.log" || true
  rm -f "$cache/pip.log"
  if [ "$pip_status" -ne 0 ]; then
    echo "arm_check: installing the aarch64 wheels failed (pip exit $pip_status)" >&2
    exit 1
  fi
  touch "$site/.done"
fi
# ARM_CHECK_PREPARE=1: the downloads and the trees alone, then stop (CI prepares them beside
# the suite, mostly waiting on the network and the disk, and runs the rest after it: the
# compiles and the emulated tests would take the suite's cores and it theirs)
if [ -n "${ARM_CHECK_PREPARE:-}" ]; then
  echo "arm_check: prepared"
  exit 0
fi

# The compiler the emulated cpp_extension calls: the cross compiler, given the tree's Python
# headers for the paths the emulated Python names (its own /usr/include); and ninja.
mkdir -p "$cache/bin"
cross=aarch64-linux-gnu-g++
if [ "$gcc" != 12 ]; then
  # trixie's compiler in its root: the repository, the cache and the directory it is called in
  # (the build's) bound there at the same paths, in a mount namespace that ends with the call
  cross=$cache/bin/g++-$gcc
  { printf '#!/usr/bin/env bash\nset -e\ntrixie=%q binds=(%q %q)\n' "$trixie" "$root" "$cache"
    cat <<'EOF'
if [ -z "${ARM_CHECK_NAMESPACE:-}" ]; then
  ARM_CHECK_NAMESPACE=1 exec unshare --mount --propagation private "$0" "$@"
fi
here=$(pwd -P)
for dir in "${binds[@]}" "$here"; do
  mkdir -p "$trixie$dir"
  mount --bind "$dir" "$trixie$dir"
done
EOF
    # shellcheck disable=SC2016 # expanded by the wrapper
    printf 'exec unshare --root="$trixie" --wd="$here" aarch64-linux-gnu-g++-%s "$@"\n' "$gcc"
  } >"$cross"
  chmod +x "$cross"
  export ARFUSE_CACHE_DIR=$cache/kernels-gcc$gcc
fi
cat >"$cache/bin/c++" <<EOF
#!/usr/bin/env bash
args=()
for a in "\$@"; do
  case \$a in
    /usr/include/python3*|-I/usr/include/python3*) a=\${a/\/usr\/include/$sysroot\/usr\/include} ;;
  esac
  args+=("\$a")
done
exec "$cross" -idirafter "$sysroot/usr/include" "\${args[@]}"
EOF
chmod +x "$cache/bin/c++"
ln -sf "$(command -v ninja || echo "$root/.venv/bin/ninja")" "$cache/bin/ninja"

export QEMU_LD_PREFIX=$sysroot CXX=$cache/bin/c++ PATH=$cache/bin:$PATH
export PYTHONPATH=$root/src:$site
# the ranks use neither torch.compile nor transformers (tests/harness.py)
export ARFUSE_TEST_PRELOAD=${ARFUSE_TEST_PRELOAD:-"torch torch.distributed arfuse"}
python=$sysroot/usr/bin/python3.11
# The kernel of each instruction set, compiled side by side (a thread each, each compile a
# process of its own) before pytest starts, which then finds them built (tests/test_isa_paths.py
# builds none itself then, and spares the process it would start for it).
"$python" - <<'EOF'
import platform
from concurrent.futures import ThreadPoolExecutor

import torch

from arfuse.backends.shm import build

print("arm_check:", platform.machine(), "Python", platform.python_version(), "torch",
      torch.__version__, flush=True)
isas = build.host_isas()
with ThreadPoolExecutor(len(isas)) as pool:
    for isa, (module, why) in zip(isas, pool.map(build._build, isas), strict=True):
        if module is None:  # the tests say it again, with their context
            print(f"arm_check: {isa}: no kernel: {why}", flush=True)
EOF
exec "$python" -m pytest -q -p no:cacheprovider "${@:-tests/test_isa_paths.py}"
