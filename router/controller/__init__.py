"""Code run by Serve's controller: the autoscaling policy, and the policy config it reads."""
