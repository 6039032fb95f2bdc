# Sourced by scripts/demo and scripts/test: sets up what they need on a machine that has only
# Rust and Python 3, so that the README's two commands work on a fresh machine with no step done
# by hand.
#   - As root on Debian/Ubuntu (env_system): installs the system packages with apt-get (fuse3 for
#     mounts, util-linux's setpriv, rsync, SLURM + munge for the job tests, cmake and nasm for the
#     JPEG decoder, python3-venv), gives /dev/fuse mode 0666 (what udev gives it on every
#     distribution; containers without udev leave 0600, and then only root can mount), and
#     creates the two unprivileged test accounts (stagefs-test, stagefs-test2).
#   - As a normal user: names what is missing and how to get it; the tests that need it print
#     "skipped: needs ..." and count as skipped (under CI=true they fail instead).
#   - A virtual environment in .venv/ (ignored by git) with tests/requirements.txt, torch and
#     torchvision (tests/requirements-torch.txt; STAGEFS_TORCH=0 skips them: ~5 GB), cmake from
#     PyPI when the system has none, and the stagefs Python package built from gpu/python.
# Afterwards: $VENV_PY is the environment's python, .venv/bin is first on PATH.
# shellcheck shell=bash
STAGEFS_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# One target directory for every worktree of a clone: a linked worktree (`git worktree add`)
# builds into the main worktree's target/ unless CARGO_TARGET_DIR says otherwise, so N
# worktrees do not fill the disk with N copies of arrow and parquet (docs/development.md#worktrees).
if [[ -z "${CARGO_TARGET_DIR:-}" ]]; then
  _common=$(git -C "$STAGEFS_ROOT" rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)
  _gitdir=$(git -C "$STAGEFS_ROOT" rev-parse --path-format=absolute --git-dir 2>/dev/null || true)
  if [[ -n $_common && $_common != "$_gitdir" && $(basename "$_common") == .git ]]; then
    export CARGO_TARGET_DIR="$(dirname "$_common")/target"
  fi
  unset _common _gitdir
fi
# Where cargo puts what it builds (the binary the tests run is $STAGEFS_TARGET/debug/stagefs).
STAGEFS_TARGET=${CARGO_TARGET_DIR:-$STAGEFS_ROOT/target}
VENV=$STAGEFS_ROOT/.venv
VENV_PY=$VENV/bin/python
# The accounts the tests switch to (as root) to check a normal user's mount and the security
# boundaries between two users of one node.
STAGEFS_TEST_USERS=(stagefs-test stagefs-test2)

env_say() { printf '== %s\n' "$*"; }

env_have() { command -v "$1" >/dev/null 2>&1 || [[ -x "/usr/sbin/$1" || -x "/sbin/$1" ]]; }

# Debian package names of what is missing, one line.
env_missing_system_packages() {
  local missing=()
  env_have fusermount3 || missing+=(fuse3)
  env_have setpriv || missing+=(util-linux)
  env_have rsync || missing+=(rsync)
  env_have slurmctld || missing+=(slurmctld)
  env_have slurmd || missing+=(slurmd)
  env_have sbatch || missing+=(slurm-client)
  env_have munged || missing+=(munge)
  # ip(8): the network namespaces of tests/slurm_multinode.sh's nodes.
  env_have ip || missing+=(iproute2)
  # The image views' libjpeg-turbo is built from vendored source by turbojpeg-sys: cmake (else
  # env_venv takes it from PyPI), nasm for its SIMD code (optional: without it the decoder is
  # built without SIMD, see env_notice_nasm).
  env_have cmake || missing+=(cmake)
  nasm -v >/dev/null 2>&1 || missing+=(nasm)
  # venv for the python3 a normal user gets (Debian's), and for the one on PATH.
  local py
  for py in python3 /usr/bin/python3; do
    if env_have "$py" && ! "$py" -c 'import ensurepip' >/dev/null 2>&1; then
      missing+=(python3-venv)
      break
    fi
  done
  echo "${missing[@]}"
}

env_system_packages() {
  local missing
  missing=$(env_missing_system_packages)
  [[ -z "$missing" ]] && return 0
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    env_say "installing system packages: $missing"
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086
    if ! apt-get install -y -qq --no-install-recommends $missing ca-certificates >/dev/null; then
      # A fresh machine's package lists may be empty or stale.
      apt-get update -qq
      # shellcheck disable=SC2086
      apt-get install -y -qq --no-install-recommends $missing ca-certificates >/dev/null
    fi
  else
    echo "missing system packages: $missing"
    echo "  (as root on Debian/Ubuntu: apt-get install $missing); what needs them is skipped"
  fi
}

# /dev/fuse usable by normal users (fusermount3 then mounts for them).
env_dev_fuse() {
  [[ -e /dev/fuse ]] || { echo "no /dev/fuse on this machine: mounts are skipped"; return 0; }
  local mode
  mode=$(stat -c %a /dev/fuse)
  [[ "$mode" == 666 ]] && return 0
  if [[ $(id -u) -eq 0 ]]; then
    env_say "chmod 0666 /dev/fuse (was $mode: no udev here; every distribution ships 0666)"
    chmod 0666 /dev/fuse
  else
    echo "/dev/fuse has mode $mode: only root can mount here (as root: chmod 0666 /dev/fuse)"
  fi
}

env_test_accounts() {
  [[ $(id -u) -eq 0 ]] || return 0
  local u
  for u in "${STAGEFS_TEST_USERS[@]}"; do
    id "$u" >/dev/null 2>&1 && continue
    env_say "creating the test account $u (the tests switch to it to mount as a normal user)"
    useradd --create-home --shell /bin/bash "$u"
  done
}

# One line when the JPEG decoder is built without SIMD (no nasm): decodes are slower, nothing
# else changes. docs/install.md#without-nasm gives both builds' speeds.
env_notice_nasm() {
  nasm -v >/dev/null 2>&1 && return 0
  echo "notice: nasm not found: libjpeg-turbo is built without SIMD (JPEG views decode slower; install nasm for the fast build)"
}

# Everything a machine needs before building and testing: packages, /dev/fuse, accounts.
env_system() {
  env_system_packages
  env_dev_fuse
  env_test_accounts
  env_notice_nasm
}

env_venv() {  # requirement files under tests/ to install: requirements.txt [requirements-torch.txt]
  if [[ ! -x "$VENV_PY" ]]; then
    env_say "creating $VENV"
    python3 -m venv "$VENV" || {
      echo "python3 -m venv failed: install python3-venv (Debian), or use a Python with venv" >&2
      return 1
    }
  fi
  local file stamp
  for file in "$@"; do
    [[ "$file" == requirements-torch.txt && "${STAGEFS_TORCH:-1}" == 0 ]] && continue
    # Reinstall only when the file changed since it was last installed.
    stamp=$VENV/.stagefs-$file
    if ! cmp -s "$STAGEFS_ROOT/tests/$file" "$stamp"; then
      env_say "installing tests/$file into $VENV"
      local start=$SECONDS
      # --no-compile: byte-compiling torch's thousands of modules at install is minutes of CPU
      # that an import does lazily anyway.
      "$VENV_PY" -m pip install -q --disable-pip-version-check --no-compile -r "$STAGEFS_ROOT/tests/$file"
      cp "$STAGEFS_ROOT/tests/$file" "$stamp"
      echo "   took $((SECONDS - start)) s; $(du -sh "$VENV" | cut -f1) in $VENV now"
    fi
  done
  export PATH=$VENV/bin:$PATH VIRTUAL_ENV=$VENV PYO3_PYTHON=$VENV_PY
  # Without root (no apt-get), cmake comes as a wheel: the Rust build needs it.
  if ! command -v cmake >/dev/null 2>&1; then
    env_say "cmake from PyPI into $VENV (building libjpeg-turbo needs it)"
    "$VENV_PY" -m pip install -q --disable-pip-version-check cmake
  fi
}

env_python_package() {
  env_say "building the stagefs Python package (gpu/python)"
  (cd "$STAGEFS_ROOT" && maturin develop -q -m gpu/python/Cargo.toml)
  # Later cargo builds see pyo3's configuration exactly as maturin gave it, so a plain
  # `cargo build --workspace` does not rebuild pyo3 (and the next maturin run not again).
  local config
  config=$(ls "${CARGO_TARGET_DIR:-$STAGEFS_ROOT/target}"/maturin/pyo3-config-*.txt 2>/dev/null | head -1 || true)
  [[ -n "$config" ]] && export PYO3_CONFIG_FILE=$config PYO3_BUILD_EXTENSION_MODULE=1
  return 0
}
