#!/bin/sh
# Open MPI's launch agent on the test cluster (cluster.sh sets it as plm_rsh_agent): called as
# `netns_agent.sh HOST COMMAND...` where ssh would log in to HOST, it runs the command line on
# that host: in its network namespace, in a UTS namespace that carries its hostname.
host=$1
shift
case $host in
  10.213.0.*) i=$((${host##*.} - 1)) ;;
  node*) i=${host#node} ;;
  *) echo "netns_agent.sh: unknown host $host (expected 10.213.0.N or nodeN)" >&2; exit 1 ;;
esac
exec nsenter --net="/run/netns/${DATTN_CLUSTER_PREFIX:?set by cluster.sh}h$i" unshare --uts \
  sh -c "hostname node$i && $*"
