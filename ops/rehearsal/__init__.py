"""A rehearsal of the multi-host path on one machine (``ops/rehearse.sh``): hosts in network namespaces
with their own sshd and slurmd, paper.yaml's topology in miniature on CPU, and the failures that only
appear at scale (``cluster`` builds and removes the hosts; ``checks`` runs the rehearsal on them)."""
