"""Write helm/specdec/values.schema.json, the JSON schema of the chart's values.

    python deploy/values_schema.py          # rewrite the schema after changing values.yaml
    python deploy/values_schema.py --check  # exit 1 if the committed schema is stale (tests do this)

Kept as code so the shared parts (a component's probes, GPU, scheduling) are written once.
Kubernetes objects passed through unchanged (affinity, tolerations, env, security contexts)
are only checked for their JSON type here; the rendered objects are validated against the
Kubernetes schemas by tests/deploy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "helm" / "specdec" / "values.schema.json"


def obj(props: dict, required: list[str] | None = None, extra: bool = False, desc: str | None = None) -> dict:
    """An object with these properties; unknown keys are rejected unless `extra`."""
    o = {"type": "object", "properties": props, "additionalProperties": extra}
    if required:
        o["required"] = required
    if desc:
        o["description"] = desc
    return o


def typed(kind: str, desc: str | None, **kw) -> dict:
    return {"type": kind, **({"description": desc} if desc else {}), **kw}


# Short names keep the tables below readable.
def S(desc: str | None = None, **kw) -> dict:
    return typed("string", desc, **kw)


def I(desc: str | None = None, **kw) -> dict:  # noqa: E743 (S, I, B: one letter per JSON type)
    return typed("integer", desc, **kw)


def B(desc: str | None = None) -> dict:
    return typed("boolean", desc)


string_map = {"type": "object", "additionalProperties": {"type": "string"}}
int_or_percent = {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[0-9]+%$"}]}

defs = {
    "imageOverride": obj({
        "repository": S("Image repository.", minLength=1),
        "tag": S("Image tag."),
        "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    }, desc="Overrides of the global image for one component."),
    "quantities": {"type": "object", "additionalProperties": {"type": ["string", "number"]}},
    "resources": obj({
        "requests": {"$ref": "#/definitions/quantities"},
        "limits": {"$ref": "#/definitions/quantities"},
        "claims": {"type": "array"},
    }, desc="Container resources (GPUs are added from `gpu`)."),
    "gpu": obj({
        "count": I("GPUs per replica (0: CPU only).", minimum=0),
        "resourceName": S("Extended resource name of the GPU.", minLength=1),
        "type": S("GPU type (value of the node label `typeLabel`); empty: any."),
        "typeLabel": S("Node label that names the GPU type.", minLength=1),
    }, required=["count", "resourceName", "type", "typeLabel"]),
    "probe": obj({
        "initialDelaySeconds": I(minimum=0),
        "periodSeconds": I(minimum=1),
        "timeoutSeconds": I(minimum=1),
        "failureThreshold": I(minimum=1),
        "successThreshold": I(minimum=1),
        "terminationGracePeriodSeconds": I(minimum=1),
    }, required=["periodSeconds", "failureThreshold"]),
    "probes": obj({
        "startup": {"$ref": "#/definitions/probe",
                    "description": "Startup probe: period × failureThreshold is the model-load budget."},
        "readiness": {"$ref": "#/definitions/probe"},
        "liveness": {"$ref": "#/definitions/probe"},
    }, required=["startup", "readiness", "liveness"]),
    "pdb": obj({
        "enabled": B("Create a PodDisruptionBudget."),
        "maxUnavailable": {**int_or_percent, "description": "Pods a voluntary disruption may take down at once."},
    }, required=["enabled", "maxUnavailable"]),
    "rollingUpdate": obj({"maxUnavailable": int_or_percent, "maxSurge": int_or_percent}),
    "port": I("A TCP port.", minimum=1, maximum=65535),
    "dtype": {"enum": ["auto", "float32", "bfloat16", "float16", "float64"],
              "description": "Weight dtype (auto: bfloat16 on a CUDA GPU with native bfloat16, else float32)."},
    "device": {"type": "string", "pattern": "^(|auto|cpu|cuda|cuda:[0-9]+)$",
               "description": "auto, cpu, cuda or cuda:N; empty: cuda when gpu.count > 0, else cpu."},
    "threads": {"type": ["integer", "null"], "minimum": 1,
                "description": "torch intra-op threads; null: torch's choice."},
    "args": {"type": "array", "items": {"type": "string"}, "description": "Extra command-line flags."},
    "env": {"type": "array", "items": {"type": "object", "required": ["name"],
                                       "properties": {"name": {"type": "string", "minLength": 1}}}},
    "tolerations": {"type": "array", "items": {"type": "object"}},
    "affinity": {"type": "object"},
    "spread": {"type": "array", "items": {"type": "object"}},
}


def scheduling() -> dict:
    """Values every service component shares: scheduling, rollout, probes, image, args."""
    return {
        "nodeSelector": string_map,
        "tolerations": {"$ref": "#/definitions/tolerations"},
        "affinity": {"$ref": "#/definitions/affinity"},
        "topologySpreadConstraints": {"$ref": "#/definitions/spread"},
        "priorityClassName": S("Priority class of the pods."),
        "podAnnotations": string_map,
        "podLabels": string_map,
        "rollingUpdate": {"$ref": "#/definitions/rollingUpdate"},
        "terminationGracePeriodSeconds": I(minimum=0),
        "probes": {"$ref": "#/definitions/probes"},
        "pdb": {"$ref": "#/definitions/pdb"},
        "image": {"$ref": "#/definitions/imageOverride"},
        "extraArgs": {"$ref": "#/definitions/args"},
        "env": {"$ref": "#/definitions/env"},
        "resources": {"$ref": "#/definitions/resources"},
    }


def model_service() -> dict:
    """Values of draft and target (the model services)."""
    return {
        "replicas": I("Replicas.", minimum=0),
        "model": S("Model: packaged default name, a directory in the model cache or a transformers id.", minLength=1),
        "dtype": {"$ref": "#/definitions/dtype"},
        "device": {"$ref": "#/definitions/device"},
        "threads": {"$ref": "#/definitions/threads"},
        "maxSessions": I("KV caches kept at most per replica.", minimum=1),
        "idleTtlS": {"type": "number", "exclusiveMinimum": 0,
                     "description": "Seconds an unused session cache is kept."},
        "port": {"$ref": "#/definitions/port"},
        "gpu": {"$ref": "#/definitions/gpu"},
        **scheduling(),
    }


common_required = ["replicas", "port", "resources", "probes", "pdb", "rollingUpdate"]

target = obj(model_service(), required=common_required + ["model", "dtype", "gpu"],
             desc="The target service (large model).")
draft_props = model_service()
draft_props.update({
    "enabled": B("Run a draft service (false: plain decoding, k = 0)."),
    "proposer": {"enum": ["suffix", "ngram", "model", "hybrid"], "description": "Draft source."},
    "ngramMin": I(minimum=1), "ngramMax": I(minimum=1),
    "suffix": obj({
        "sharedCorpus": B("Read the orchestrator's stream of finished outputs from its Redis."),
        "maxTokens": I("Most tokens of earlier outputs indexed per replica.", minimum=1),
    }),
})
draft = obj(draft_props, required=common_required + ["enabled", "proposer", "model", "dtype", "gpu"],
            desc="The draft service (suffix speculation, prompt lookup or a small model).")

def service() -> dict:
    """The Service of a public API (orchestrator, gateway)."""
    return obj({
        "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
        "port": {"$ref": "#/definitions/port"},
        "annotations": string_map,
    }, required=["type", "port"])


def autoscaling() -> dict:
    """A CPU HorizontalPodAutoscaler (orchestrator, gateway)."""
    return obj({
        "enabled": B(), "minReplicas": I(minimum=1), "maxReplicas": I(minimum=1),
        "targetCPUUtilizationPercentage": I(minimum=1, maximum=100),
    }, required=["enabled", "minReplicas", "maxReplicas", "targetCPUUtilizationPercentage"])


orch_props = {
    "replicas": I("Replicas (when not autoscaled).", minimum=0),
    "model": S("Tokenizer model; empty: target.model."),
    "draftLength": {"oneOf": [{"const": "auto"}, {"type": "integer", "minimum": 0}],
                    "description": "'auto' or a fixed k."},
    "maxDraftLength": I(minimum=0, maximum=64),
    "overlap": B("Draft the next block during the verify."),
    "sessionTtlS": I(minimum=1),
    "port": {"$ref": "#/definitions/port"},
    "service": service(),
    "autoscaling": autoscaling(),
    "preStopSleepSeconds": I("Seconds to keep serving after the stop request.", minimum=0),
    **scheduling(),
}
orchestrator = obj(orch_props, required=common_required + ["service", "autoscaling"],
                   desc="The orchestrator (public API, the loop, sessions in Redis).")

gateway_props = {
    "enabled": B("Run the OpenAI-compatible HTTP gateway."),
    "replicas": I("Replicas (when not autoscaled).", minimum=0),
    "port": {"$ref": "#/definitions/port"},
    "modelName": S("Model id the API serves; empty: the target's."),
    "requestTimeoutS": {"type": "number", "exclusiveMinimum": 0, "description": "Deadline of one generation."},
    "healthTimeoutS": {"type": "number", "exclusiveMinimum": 0,
                       "description": "Deadline of the status call behind /health (below the readiness timeout)."},
    "auth": obj({
        "existingSecret": S("Deprecated alias of the top-level auth.existingSecret."),
        "tokensKey": S("Deprecated alias of the top-level auth.tokensKey.", minLength=1),
    }, required=["existingSecret", "tokensKey"]),
    "service": service(),
    "ingress": obj({
        "enabled": B("Create an Ingress."),
        "className": S("IngressClass; empty: the cluster default."),
        "annotations": string_map,
        "hosts": {"type": "array", "items": obj({
            "host": S("Host name; empty: any."),
            "paths": {"type": "array", "minItems": 1, "items": obj({
                "path": S(pattern="^/"),
                "pathType": {"enum": ["Prefix", "Exact", "ImplementationSpecific"]},
            }, required=["path", "pathType"])},
        }, required=["paths"])},
        "tls": {"type": "array", "items": {"type": "object"}},
    }, required=["enabled", "hosts"]),
    "autoscaling": autoscaling(),
    "preStopSleepSeconds": I("Seconds to keep serving after the stop request.", minimum=0),
    **scheduling(),
}
gateway = obj(gateway_props, required=common_required + ["enabled", "service", "autoscaling", "ingress", "auth",
                                                         "requestTimeoutS", "healthTimeoutS"],
              desc="The OpenAI-compatible HTTP API in front of the orchestrator.")
gateway["allOf"] = [
    {"if": {"properties": {"ingress": {"properties": {"enabled": {"const": True}}}}},
     "then": {"properties": {"ingress": {"properties": {"hosts": {"minItems": 1}}}}}},
]

redis_url = "^rediss?://[^@/\\s]+(/[0-9]+)?$"
host_ports = "^[^,:\\s]+:[0-9]+(,[^,:\\s]+:[0-9]+)*$"
redis = obj({
    "enabled": B("Run Redis in the chart; false: use external.url."),
    "external": obj({
        "url": S("URL of an external Redis without credentials.", pattern=f"({redis_url})|^$"),
        "clusterNodes": S("Some nodes of an external Redis Cluster: host:port[,host:port...].",
                          pattern=f"({host_ports})|^$"),
        "sentinels": S("Redis Sentinels: host:port[,host:port...].", pattern=f"({host_ports})|^$"),
        "sentinelMaster": S("The master the sentinels monitor."),
        "tls": B("TLS to the cluster nodes or the sentinels and their master."),
    }, required=["url"]),
    "auth": obj({
        "enabled": B(),
        "password": S("URL-safe password; empty: generated (in-chart Redis).", pattern="^[A-Za-z0-9._~-]*$"),
        "existingSecret": S(),
        "existingSecretPasswordKey": S(minLength=1),
    }, required=["enabled", "password", "existingSecret", "existingSecretPasswordKey"]),
    "image": obj({
        "repository": S(minLength=1), "tag": S(minLength=1),
        "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    }, required=["repository", "tag"]),
    "port": {"$ref": "#/definitions/port"},
    "persistence": obj({"enabled": B(), "storageClass": S(), "size": S(minLength=1)}, required=["enabled"]),
    "maxmemory": {"type": ["string", "integer"], "pattern": "^[0-9]+([kKmMgG][bB]?)?$", "minimum": 0,
                  "description": "Redis's --maxmemory (e.g. 768mb, 3gb; 0: no cap)."},
    "maxmemoryPolicy": {"enum": ["noeviction", "volatile-lru", "allkeys-lru", "volatile-lfu", "allkeys-lfu",
                                 "volatile-random", "allkeys-random", "volatile-ttl"],
                        "description": "Redis's --maxmemory-policy; noeviction keeps every session."},
    "extraArgs": {"$ref": "#/definitions/args"},
    "resources": {"$ref": "#/definitions/resources"},
    "podSecurityContext": {"type": "object"},
    "nodeSelector": string_map,
    "tolerations": {"$ref": "#/definitions/tolerations"},
    "affinity": {"$ref": "#/definitions/affinity"},
}, required=["enabled", "external", "auth", "image", "port", "persistence", "maxmemory", "maxmemoryPolicy"],
    desc="The session store.")
redis["allOf"] = [
    {"if": {"properties": {"enabled": {"const": False}}},
     "then": {"properties": {"external": {"anyOf": [
         {"properties": {"url": {"minLength": 1}}},
         {"properties": {"clusterNodes": {"minLength": 1}}},
         {"properties": {"sentinels": {"minLength": 1}, "sentinelMaster": {"minLength": 1}}}]}}}},
    {"if": {"properties": {"enabled": {"const": False}, "auth": {"properties": {"enabled": {"const": True}}}}},
     "then": {"properties": {"auth": {"anyOf": [
         {"properties": {"existingSecret": {"minLength": 1}}},
         {"properties": {"password": {"minLength": 1}}}]}}}},
]

vllm_target = obj({
    "enabled": B("Serve the target with vLLM (specdec's proposer drafting from the chart's draft pool) instead of "
                 "specdec's target, orchestrator and gateway."),
    "image": S("The vLLM image (repository:tag), with specdec installed beside vLLM; required when enabled."),
    "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    "model": S("The model vLLM serves; required when enabled."),
    "replicas": I("vLLM replicas.", minimum=0),
    "port": {"$ref": "#/definitions/port"},
    "numSpeculativeTokens": I("Longest draft vLLM schedules per request.", minimum=1, maximum=64),
    "draftTimeoutMs": {"type": "number", "exclusiveMinimum": 0,
                       "description": "Longest wait of a step for its drafts, in ms."},
    "corpusGroup": S("Corpus group of this vLLM's finished outputs.", maxLength=128),
    "shareOutputs": B("Finished outputs join the draft pool's suffix corpus."),
    "extraArgs": {"type": "array", "items": {"type": "string"}},
    "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
    "resources": {"type": "object", "description": "Resources of the vLLM container."},
    "nodeSelector": string_map,
    "tolerations": {"type": "array", "items": {"type": "object"}},
    "startupSeconds": I("Seconds for vLLM to load its model.", minimum=10),
}, required=["enabled", "image", "model", "port", "numSpeculativeTokens"],
    desc="A vLLM target beside the draft pool and Redis (docs/vllm.md).")

schema = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "specdec chart values",
    "type": "object",
    "additionalProperties": False,
    "required": ["image", "target", "draft", "orchestrator", "gateway", "redis", "modelCache", "networkPolicy",
                 "discovery", "auth"],
    "definitions": defs,
    "properties": {
        "global": {"type": "object", "description": "Helm's global values (unused)."},
        "nameOverride": S("Replaces the chart name in resource names."),
        "fullnameOverride": S("Replaces <release>-<chart> in resource names."),
        "clusterDomain": S("DNS domain of the cluster.", minLength=1),
        "auth": obj({
            "existingSecret": S("Secret holding the bearer tokens of the public APIs, mounted into the orchestrator "
                                "and the gateway; empty: no tokens."),
            "tokensKey": S("Key of the tokens file in that Secret.", minLength=1),
        }, required=["existingSecret", "tokensKey"]),
        "discovery": obj({
            "kubernetes": B("The orchestrator finds draft and target replicas through the Kubernetes API "
                            "(EndpointSlices) instead of DNS; renders its ServiceAccount, Role and RoleBinding."),
        }, required=["kubernetes"]),
        "image": obj({
            "repository": S(minLength=1), "tag": S(),
            "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
        }, required=["repository", "tag", "pullPolicy"]),
        "imagePullSecrets": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "serviceAccount": obj({"create": B(), "name": S(), "annotations": string_map}, required=["create"]),
        "podSecurityContext": {"type": "object", "description": "Pod security context of the services."},
        "containerSecurityContext": {"type": "object", "description": "Container security context of the services."},
        "modelCache": obj({
            "mountPath": S(pattern="^/"),
            "allowDownload": B("Let transformers download missing hub ids."),
            "persistence": obj({
                "enabled": B(), "existingClaim": S(), "storageClass": S(),
                "accessModes": {"type": "array", "minItems": 1, "items": {
                    "enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]}},
                "size": S(minLength=1),
            }, required=["enabled"]),
            "emptyDir": obj({"sizeLimit": S(minLength=1)}),
        }, required=["mountPath", "persistence"]),
        "tmpSizeLimit": S(minLength=1),
        "target": target,
        "draft": draft,
        "orchestrator": orchestrator,
        "gateway": gateway,
        "redis": redis,
        "vllmTarget": vllm_target,
        "metrics": obj({
            "enabled": B("Pass --metrics-port to every service and expose it."),
            "port": {"$ref": "#/definitions/port"},
            "serviceMonitor": obj({
                "enabled": B("Create a Prometheus Operator ServiceMonitor."),
                "interval": S(pattern="^[0-9]+(ms|s|m|h)$"),
                "labels": string_map,
            }, required=["enabled"]),
        }, required=["enabled", "port"]),
        "networkPolicy": obj({
            "enabled": B("Create NetworkPolicies."),
            "orchestratorFrom": {"type": "array", "items": {"type": "object"},
                                 "description": "Peers allowed to reach the orchestrator besides the gateway and the "
                                                "helm test; empty: only those (anyone without a gateway)."},
            "gatewayFrom": {"type": "array", "items": {"type": "object"},
                            "description": "Peers allowed to reach the gateway; empty: anyone."},
            "metricsFrom": {"type": "array", "items": {"type": "object"},
                            "description": "Peers allowed to scrape metrics; empty: anyone."},
        }, required=["enabled"]),
        "tests": obj({
            "prompt": S(minLength=1), "maxNewTokens": I(minimum=1), "timeoutSeconds": I(minimum=1),
        }),
    },
}


def render() -> str:
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed schema is stale")
    if parser.parse_args(argv).check:
        if SCHEMA_PATH.read_text() != render():
            sys.exit(f"{SCHEMA_PATH} is stale: run python deploy/values_schema.py")
    else:
        SCHEMA_PATH.write_text(render())


if __name__ == "__main__":
    main()
