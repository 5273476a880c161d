"""Code run by the ingress replicas (the `Ingress` deployment): HTTP and handle APIs, text
(tokenize, detokenize, stop strings), and the client side of the engine replicas."""
