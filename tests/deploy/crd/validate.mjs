// Validates Kubernetes custom resources read as a JSON array on stdin against the OpenAPI
// schemas of their CRDs (generated from KEDA's, the Prometheus Operator's and the Gateway API's
// Go types by kubernetes-models). Prints one JSON line per resource; exits 1 if any is invalid
// or unknown. No npm package carries the LeaderWorkerSet's or the InferencePool's schema:
// tests/deploy/test_chart.py checks those two by hand (deploy/README.md says what that covers).
import { readFileSync } from "node:fs";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import { HTTPRoute } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute";

const models = {
  "keda.sh/v1alpha1/ScaledObject": ScaledObject,
  "monitoring.coreos.com/v1/ServiceMonitor": ServiceMonitor,
  "gateway.networking.k8s.io/v1/HTTPRoute": HTTPRoute,
};
let failed = false;
for (const resource of JSON.parse(readFileSync(0, "utf8"))) {
  const key = `${resource.apiVersion}/${resource.kind}`;
  const Model = models[key];
  let error = null;
  if (!Model) error = `no schema for ${key}`;
  else {
    try {
      new Model(resource).validate();
    } catch (e) {
      error = e.message;
    }
  }
  failed ||= error !== null;
  console.log(JSON.stringify({ kind: key, name: resource.metadata?.name, error }));
}
process.exit(failed ? 1 : 0);
