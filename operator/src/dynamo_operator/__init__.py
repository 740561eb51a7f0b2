"""dynamo-operator: a kopf operator that runs Dynamo LLM inference workers on Kubernetes."""
