#!/usr/bin/env bash
# Make sure a PostgreSQL server answers on 127.0.0.1:5432 for the store tests.
# Uses the running one when there is one; otherwise starts the installed cluster, installing
# Debian's postgresql package first when the machine has none (as root, apt-get available).
set -euo pipefail

ready() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }

if command -v pg_isready >/dev/null && ready; then
  exit 0
fi
if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "ensure-postgres: installing PostgreSQL from Debian packages" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  else
    echo "ensure-postgres: no PostgreSQL installed and cannot install it (need root and apt-get)" >&2
    exit 1
  fi
fi
version=$(ls /etc/postgresql | sort -V | tail -n 1)
conf=/etc/postgresql/$version/main
# Trust local loopback connections: these are throwaway test clusters.
grep -q "fleet-controlplane tests" "$conf/pg_hba.conf" || {
  printf '# fleet-controlplane tests\nhost all all 127.0.0.1/32 trust\nlocal all all trust\n' | cat - "$conf/pg_hba.conf" > "$conf/pg_hba.conf.new"
  mv "$conf/pg_hba.conf.new" "$conf/pg_hba.conf"
}
pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
for _ in $(seq 1 30); do
  if ready; then
    psql -h 127.0.0.1 -U postgres -tc "SELECT 1 FROM pg_database WHERE datname='test'" | grep -q 1 \
      || psql -h 127.0.0.1 -U postgres -c "CREATE DATABASE test" >/dev/null
    psql -h 127.0.0.1 -U postgres -tc "SELECT 1 FROM pg_roles WHERE rolname='root'" | grep -q 1 \
      || psql -h 127.0.0.1 -U postgres -c "CREATE ROLE root SUPERUSER LOGIN" >/dev/null
    exit 0
  fi
  sleep 1
done
echo "ensure-postgres: PostgreSQL did not become ready on 127.0.0.1:5432" >&2
exit 1
