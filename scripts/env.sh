# Sourced by scripts/test and scripts/demo: sets up what they need, on a machine that has only
# Rust and Python 3.
#   - System packages (fuse3 for mounts, util-linux's setpriv, rsync, SLURM + munge for the
#     job tests, python3-venv): installed with apt-get when run as root on Debian/Ubuntu;
#     otherwise listed, and the tests that need them print "skipped: needs ...".
#   - A virtual environment in .venv/ (ignored by git) with tests/requirements.txt, torch and
#     torchvision (tests/requirements-torch.txt; STAGEFS_TORCH=0 skips them: ~5 GB, the CUDA
#     libraries that PyPI's Linux torch needs), and the stagefs Python package built from
#     gpu/python (maturin develop: debug build, editable).
# Afterwards: $VENV_PY is the environment's python, .venv/bin is first on PATH.
# shellcheck shell=bash
STAGEFS_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$STAGEFS_ROOT/.venv
VENV_PY=$VENV/bin/python

env_say() { printf '== %s\n' "$*"; }

env_missing_system_packages() {
  local missing=()
  have() { command -v "$1" >/dev/null 2>&1 || [[ -x "/usr/sbin/$1" || -x "/sbin/$1" ]]; }
  have fusermount3 || missing+=(fuse3)
  have setpriv || missing+=(util-linux)
  have rsync || missing+=(rsync)
  have slurmctld || missing+=(slurmctld)
  have slurmd || missing+=(slurmd)
  have sbatch || missing+=(slurm-client)
  have munged || missing+=(munge)
  # The image views' libjpeg-turbo is built from vendored source by turbojpeg-sys: cmake
  # (else env_venv takes it from PyPI), nasm for its SIMD code (optional).
  have cmake || missing+=(cmake)
  have nasm || missing+=(nasm)
  python3 -c 'import ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
  echo "${missing[@]}"
}

env_system_packages() {
  local missing
  missing=$(env_missing_system_packages)
  [[ -z "$missing" ]] && return 0
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    env_say "installing system packages: $missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing ca-certificates >/dev/null
  else
    echo "missing system packages: $missing"
    echo "  (as root on Debian/Ubuntu: apt-get install $missing); the tests that need them are skipped"
  fi
}

env_venv() {  # requirement files under tests/ to install: requirements.txt [requirements-torch.txt]
  if [[ ! -x "$VENV_PY" ]]; then
    env_say "creating $VENV"
    python3 -m venv "$VENV"
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
