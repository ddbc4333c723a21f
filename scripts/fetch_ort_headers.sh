#!/usr/bin/env bash
# Fill third_party/onnxruntime/include with ONNX Runtime's C headers from Debian's
# libonnxruntime-dev package. Download only: a private apt state directory is used, so the
# machine's apt configuration and installed packages are left as they are.
#
# The mirror is the one this machine's apt sources already name; on Debian 12 (bookworm) the
# package is taken from the trixie suite, on later releases from the machine's own release.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
dest="$here/third_party/onnxruntime"
if [ -f "$dest/include/onnxruntime_c_api.h" ]; then
  echo "ORT headers already in third_party/onnxruntime/include"
  exit 0
fi
command -v apt-get >/dev/null || {
  echo "apt-get not found: this script needs a Debian-family machine. Elsewhere, point ORT_INCLUDE_DIR" \
       "at a folder holding onnxruntime_c_api.h." >&2
  exit 1
}

. /etc/os-release
suite=${ORT_HEADERS_SUITE:-${VERSION_CODENAME:-trixie}}
case "$suite" in bullseye|bookworm) suite=trixie ;; esac

# The Debian mirror this machine already uses: the first URI of a source serving Debian 'main'.
mirror=$( (grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
           grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}') \
          | grep -E '/debian/?$' | head -n 1) || true
[ -n "$mirror" ] || {
  echo "No Debian mirror found in this machine's apt sources. Point ORT_INCLUDE_DIR at a folder" \
       "holding onnxruntime_c_api.h (from any ONNX Runtime 1.18+ release) instead." >&2
  exit 1
}

state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT
mkdir -p "$state/lists/partial" "$state/cache/archives/partial" "$state/parts" "$state/prefs"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
echo "deb [signed-by=$keyring] $mirror $suite main" > "$state/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$state/sources.list" -o "Dir::Etc::SourceParts=$state/parts"
          -o "Dir::Etc::PreferencesParts=$state/prefs" -o "Dir::State::Lists=$state/lists"
          -o "Dir::Cache=$state/cache" -o "Dir::State::Status=/dev/null"
          -o "APT::Get::List-Cleanup=0" -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")

echo "Fetching libonnxruntime-dev ($suite) headers..."
apt-get "${apt_opts[@]}" -qq update
(cd "$state" && apt-get "${apt_opts[@]}" -qq download libonnxruntime-dev)
dpkg-deb -x "$state"/libonnxruntime-dev_*.deb "$state/root"

mkdir -p "$dest/include"
cp "$state"/root/usr/include/onnxruntime/*.h "$dest/include/"
dpkg-deb -f "$state"/libonnxruntime-dev_*.deb Version > "$dest/VERSION"
echo "ORT headers $(cat "$dest/VERSION") -> third_party/onnxruntime/include"
