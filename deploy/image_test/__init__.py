"""Run what a Helm chart renders as podman containers on one machine (`make image-test`).

- `manifests`:  the objects `helm template` rendered -> containers (`translate`) that keep the
                manifests' own image, command, args, env (values, Secrets, ConfigMaps, `$(VAR)`
                expansion), ports, user and group, read-only root, capabilities, memory limit,
                volumes (emptyDir, PersistentVolumeClaim, Secret, ConfigMap) and probes; `helm test`
                Pods (annotation `helm.sh/hook: test`) become test containers. Needs no podman;
                tests/deploy/test_image_translator.py checks it on the rendered chart.
- `podman`:     those containers as `podman run` arguments, env files, a hosts file and volume
                folders; the podman command itself.
- `kubelet`:    probes the running containers (exec probes with `podman exec`; gRPC, TCP and HTTP
                from the pod's network namespace, as the kubelet does) and restarts those that exit
                or fail liveness.
- `acceptance`: what a passing run must show: every workload ready, the chart's test Pods pass, an
                OpenAI-client request through the HTTP gateway completes, and after one workload's
                container (the target by default) is killed the next request still completes once
                it has been restarted.
- `cli`:        the command: render the chart, find the images, make the pod (no network but its own
                loopback: every Service name resolves to 127.0.0.1 through a mounted hosts file),
                run the acceptance inside its network namespace (nsenter), remove everything.

Differences from a cluster, on purpose: one replica per workload (replicas share the pod's
loopback, so two would collide on their port); resource requests are not enforced (limits on
memory and CPU are); preStop hooks and PodDisruptionBudgets, NetworkPolicies, HPAs and
ServiceMonitors are not used.

    python -m deploy.image_test run --helm .tools/bin/helm --chart helm/specdec
    python -m deploy.image_test commands --rendered rendered.yaml     # print the podman commands
"""
