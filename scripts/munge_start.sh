# Sourced by the Slurm scripts: makes sure munged runs (a key, its directories), starting
# one whose pid file is "$dir/munge/munged.pid" when none answers. Needs `dir` set.
mkdir -p "$dir/munge"
chmod 755 "$dir"
chown munge:munge "$dir/munge"
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  # Its pid file in /run/munge: munged must walk the path to it, and "$dir" may sit under a
  # directory only root can enter (pytest's /tmp/pytest-of-root is 0700). Root copies it.
  runuser -u munge -- munged --pid-file=/run/munge/distrib_tf-munged.pid --force
  sleep 1
  cp /run/munge/distrib_tf-munged.pid "$dir/munge/munged.pid"
fi
