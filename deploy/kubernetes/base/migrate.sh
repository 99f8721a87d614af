#!/bin/sh
# The `migrate` init container of every gateway and worker pod: the schema at this image's head before
# the app starts, without making a restart depend on Postgres.
#
# - Postgres answers: `tollgate migrate` (Alembic upgrade to head, under an advisory lock, so concurrent
#   pods run each migration once and the others find it done), then the head is recorded on the files
#   volume that every gateway and worker pod shares. A migration that fails fails the pod: it does not
#   start on a schema its code does not expect.
# - Postgres does not answer (an outage, a network partition): a pod whose image's head is the recorded
#   one starts anyway, since the schema already reached it: a restart, a rescheduled pod or one the
#   autoscaler adds must not wait for the database (the gateway serves what Redis and its caches allow).
#   A pod of a newer release (whose head was never recorded) waits, and its rollout with it, until
#   Postgres is back and its migrations ran: it would not run on an older schema.
#
# Whatever migrates records what it reached, a rollback's downgrade included (its pods migrate to their
# own head, which is then the recorded one).
set -eu
record="${TOLLGATE_SCHEMA_RECORD:-/var/lib/tollgate/files/.schema-revision}"
head=$(python -c 'from alembic.script import ScriptDirectory
from tollgate.schema import alembic_config
print(ScriptDirectory.from_config(alembic_config()).get_current_head())')

if python -c 'import socket, sys, urllib.parse
url = urllib.parse.urlsplit(sys.argv[1])
socket.create_connection((url.hostname, url.port or 5432), timeout=10).close()' "$TOLLGATE_DATABASE_URL"
then
  tollgate migrate
  printf '%s\n' "$head" > "$record.tmp.$$"
  mv "$record.tmp.$$" "$record"
  exit 0
fi
if [ -f "$record" ] && [ "$(cat "$record")" = "$head" ]; then
  echo "migrate: Postgres does not answer; the schema reached $head (this image's head) before: starting"
  exit 0
fi
echo "migrate: Postgres does not answer, and the schema is not known to be at $head (this image's head):" \
     "not starting before it is" >&2
exit 1
