# Sourced by the benchmark scripts: `need TOOL PACKAGES WHAT` makes sure a program the script
# runs is installed. Missing, it is installed with apt-get when this runs as root on a machine
# that has apt-get (unless WEFT_BENCH_NO_INSTALL=1); otherwise the script stops with a message
# naming what is missing and how to install it (exit status 3).
need() {
  local tool=$1 packages=$2 what=$3 me
  me=$(basename "$0")
  command -v "$tool" >/dev/null && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ "${WEFT_BENCH_NO_INSTALL:-0}" != 1 ]; then
    echo "$me: $what is not installed (no $tool): installing $packages with apt-get" \
      "(WEFT_BENCH_NO_INSTALL=1 to refuse)" >&2
    if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $packages >/dev/null \
      && command -v "$tool" >/dev/null; then
      return 0
    fi
    echo "$me: installing $packages failed" >&2
  fi
  echo "$me: $what is needed and not installed (no $tool on PATH)." >&2
  echo "$me: install it (Debian/Ubuntu: apt-get install $packages; elsewhere your system's" \
    "package of $what) and run this again." >&2
  exit 3
}
