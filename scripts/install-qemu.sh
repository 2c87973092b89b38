#!/usr/bin/env bash
# Install a static `qemu-x86_64` (QEMU 8 or newer) for the emulated AVX2 lane
# (scripts/test-cpu-kinds.sh). Debian 12's own qemu-user (7.2) mis-emulates AVX2: numpy's AVX2
# argsort returns unsorted indices under it. QEMU 10 from the release's backports suite does not.
# Only that one binary is extracted from the .deb, into /usr/local/bin; apt's own sources and
# state are left as they are (a private list and state folder are used). Needs root and apt.
set -euo pipefail
QEMU_MIN_MAJOR=8
dest=${QEMU_DEST:-/usr/local/bin/qemu-x86_64}

qemu_major() {  # the major version of the qemu-x86_64 at $1, or 0
  "$1" --version 2>/dev/null | sed -n 's/^qemu-x86_64 version \([0-9]*\)\..*/\1/p' | head -1 | grep . || echo 0
}

for have in "$dest" "$(command -v qemu-x86_64 || true)"; do
  if [ -n "$have" ] && [ -x "$have" ] && [ "$(qemu_major "$have")" -ge "$QEMU_MIN_MAJOR" ]; then
    echo "qemu-x86_64 $(qemu_major "$have") already at $have"
    exit 0
  fi
done
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
  echo "install-qemu: needs root and apt-get; install QEMU >= $QEMU_MIN_MAJOR's qemu-user by hand" >&2
  exit 1
fi

. /etc/os-release
codename=${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}
# the Debian mirror apt already uses (deb822 .sources or one-line .list files)
mirror=$(grep -hoE '^(URIs:[[:space:]]*|deb[[:space:]]+(\[[^]]*\][[:space:]]+)?)https?://[^[:space:]]+' \
  /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
  | grep -oE 'https?://[^[:space:]]+' | grep -v security | head -1 || true)
mirror=${mirror:-http://deb.debian.org/debian}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
printf 'deb [signed-by=%s] %s %s main\ndeb [signed-by=%s] %s %s-backports main\n' \
  "$keyring" "$mirror" "$codename" "$keyring" "$mirror" "$codename" >"$work/sources.list"
apt_opts=(-o "Dir::Etc::sourcelist=$work/sources.list" -o "Dir::Etc::sourceparts=-"
  -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "APT::Sandbox::User=root")
apt-get "${apt_opts[@]}" update -qq
cd "$work"
# the backports build where there is one (QEMU 10 on Debian 12), else the release's own
apt-get "${apt_opts[@]}" download -qq "qemu-user/$codename-backports" 2>/dev/null \
  || apt-get "${apt_opts[@]}" download -qq qemu-user
dpkg-deb -x qemu-user_*.deb "$work/deb"
install -m 0755 "$work/deb/usr/bin/qemu-x86_64" "$dest"
got=$(qemu_major "$dest")
if [ "$got" -lt "$QEMU_MIN_MAJOR" ]; then
  echo "install-qemu: got QEMU $got from $mirror ($codename); the lane needs >= $QEMU_MIN_MAJOR" >&2
  exit 1
fi
echo "qemu-x86_64 installed: $("$dest" --version | head -1)"
