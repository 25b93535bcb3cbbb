# shellcheck shell=bash
# What scripts/build-test-image and scripts/build-image share: a trimmed Debian rootfs from debootstrap, built as
# root into a cache (a lock serialises builds; each script writes to a temporary name and renames it).
# The caller sets LOG_NAME (its name, for messages) and CACHE (the cache folder) before sourcing this file.

log() { echo "$LOG_NAME: $*" >&2; }

# Run the calling script again through sudo when not root (debootstrap and chroot need root); else fail.
rootfs_need_root() {
    local script=$1 target=$2
    shift 2
    [[ $(id -u) == 0 ]] && return 0
    if command -v sudo >/dev/null; then
        log "needs root (debootstrap) to build $target: running it again with sudo"
        exec sudo -- env "AIRLOCK_IMAGE_CACHE=$CACHE" ${AIRLOCK_DEBIAN_MIRROR:+"AIRLOCK_DEBIAN_MIRROR=$AIRLOCK_DEBIAN_MIRROR"} \
            ${DOCKER_HOST:+"DOCKER_HOST=$DOCKER_HOST"} "$script" "$@"
    fi
    log "needs root (debootstrap) to build $target"
    exit 1
}

# Take the cache's build lock (held until the script and every child of it exit: a build killed half-way keeps it
# until its last process is gone), then remove what builds killed before left: under the lock none is running.
rootfs_lock() {
    mkdir -p "$CACHE"
    exec 9>"$CACHE/.build.lock"
    flock 9
    rm -rf --one-file-system "$CACHE"/.build-*
}

rootfs_mirror() {
    local suite=$1 site
    if [[ -n ${AIRLOCK_DEBIAN_MIRROR:-} ]]; then
        echo "$AIRLOCK_DEBIAN_MIRROR"
        return
    fi
    # The site apt itself uses for this suite (e.g. a local mirror or a snapshot), else the default.
    site=$(apt-get indextargets --format '$(SITE) $(RELEASE)' 2>/dev/null | awk -v s="$suite" '$2 == s {print $1; exit}')
    echo "${site:-http://deb.debian.org/debian}"
}

# debootstrap SUITE (minbase + PACKAGES) into ROOT, its log in LOG.
rootfs_debootstrap() {
    local root=$1 suite=$2 arch=$3 packages=$4 log_file=$5 mirror
    if ! command -v debootstrap >/dev/null; then
        log "debootstrap not found (apt-get install --no-install-recommends debootstrap)"
        exit 1
    fi
    mirror=$(rootfs_mirror "$suite")
    # An HTTP proxy configured for apt applies to debootstrap too.
    if [[ -z ${http_proxy:-} ]]; then
        eval "$(apt-config shell http_proxy Acquire::http::Proxy 2>/dev/null || true)"
        if [[ -n ${http_proxy:-} ]]; then export http_proxy; fi
    fi
    log "debootstrap $suite ($arch, minbase + $packages) from $mirror; log in $log_file"
    # A private mount namespace: whatever debootstrap mounts (/proc, /sys, and inside a container bind mounts of
    # /dev entries) disappears with it, even if it dies half-way.
    if ! unshare --mount --propagation private \
        debootstrap --variant=minbase --arch="$arch" --include="$packages" "$suite" "$root" "$mirror" >"$log_file" 2>&1; then
        log "debootstrap failed; last lines of $log_file:"
        tail -n 30 "$log_file" >&2
        exit 1
    fi
}

# Trim package caches, lists, docs, logs; replace the host-specific files debootstrap copied in.
rootfs_trim() {
    local root=$1 hostname=$2
    rm -rf --one-file-system \
        "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
        "$root"/var/log/* "$root"/var/cache/debconf/*-old "$root"/var/lib/dpkg/*-old
    : >"$root/etc/resolv.conf"  # docker bind-mounts its own; never ship the build host's resolvers
    chmod 644 "$root/etc/resolv.conf"
    printf '127.0.0.1\tlocalhost\n' >"$root/etc/hosts"
    echo "$hostname" >"$root/etc/hostname"
}

# Fail unless every path (relative to ROOT) exists.
rootfs_require() {
    local root=$1 f
    shift
    for f in "$@"; do
        if [[ ! -e $root/$f ]]; then
            log "built rootfs lacks /$f"
            exit 1
        fi
    done
}

# tar ROOT to OUT (through a temporary name in WORK: a reader never sees half a file); drop other builds named
# PATTERN (spared for an hour, in case a run still uses one).
rootfs_pack() {
    local root=$1 work=$2 out=$3 pattern=$4
    tar --numeric-owner --xattrs --xattrs-include='*' -C "$root" -cf "$work/image.tar" .
    mv -f "$work/image.tar" "$out"  # same file system: an atomic rename
    find "$(dirname "$out")" -maxdepth 1 -name "$pattern" ! -name "$(basename "$out")" -mmin +60 -delete
}
