#!/bin/sh
# Start Redis for tooloop with an ACL: user `default` off, user `tooloop` with REDIS_PASSWORD.
# The password never appears on a command line (ps) or in a shipped file: it is written to
# an ACL file readable by the Redis user only, at each start.
set -eu
: "${REDIS_PASSWORD:?set REDIS_PASSWORD (letters and digits, 32 or more recommended)}"
case "$REDIS_PASSWORD" in
  *[!A-Za-z0-9._~+/=-]*) echo "REDIS_PASSWORD: use letters, digits and ._~+/=- only" >&2; exit 2 ;;
esac
conf="${REDIS_CONF:-/usr/local/etc/redis/redis.conf}"
acl="${REDIS_ACL_FILE:-/tmp/tooloop-users.acl}"
umask 077
# tooloop needs every data command (Lua, streams, lists, pub/sub), never the server's own:
# no FLUSHALL/FLUSHDB, CONFIG, DEBUG, SHUTDOWN, MONITOR, replication or module commands.
printf '%s\n' \
  "user default off" \
  "user tooloop on >$REDIS_PASSWORD ~* &* +@all -flushall -flushdb -swapdb -config -debug -shutdown -monitor -module -replicaof -slaveof -failover -sync -psync -save -bgsave -bgrewriteaof -migrate -restore -acl" \
  > "$acl"
exec redis-server "$conf" --aclfile "$acl" "$@"
