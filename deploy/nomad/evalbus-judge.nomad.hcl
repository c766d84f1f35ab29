# evalbus-judge on Nomad. The judge: applies each batch's judges (judge-cases). JUDGE_MAX_IN_FLIGHT caps the cases judged
# at once across ALL allocations; a model provider's calls follow an adaptive limit they share, at most JUDGE_GLOBAL_LIMIT.
#
#   nomad var put nomad/jobs/evalbus-judge nats_url=...
#   nomad job run -var image=registry.example.com/evalbus/judge:0.1.0 deploy/nomad/evalbus-judge.nomad.hcl
#
# Credentials come from the job's Nomad Variable, never from this file. Scaled by the Nomad
# Autoscaler on its consumers' lag, read from Prometheus (the NATS exporter of deploy/nomad/nats).

variable "image" {
  type        = string
  description = "The evalbus-judge image (deploy/docker/judge.Dockerfile)."
  default     = "evalbus/judge:0.1.0"
}

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

job "evalbus-judge" {
  type        = "service"
  datacenters = var.datacenters

  # One allocation at a time; a new version that does not turn healthy is rolled back.
  update {
    max_parallel      = 1
    min_healthy_time  = "10s"
    healthy_deadline  = "5m"
    progress_deadline = "10m"
    auto_revert       = true
  }

  group "judge" {
    count = 1

    network {
      port "http" {
        to = 8080
      }
    }

    service {
      name     = "evalbus-judge"
      port     = "http"
      provider = "nomad"
      tags     = ["evalbus", "metrics"]

      check {
        name     = "ready"
        type     = "http"
        path     = "/readyz"
        interval = "10s"
        timeout  = "3s"
      }

      check {
        name     = "alive"
        type     = "http"
        path     = "/healthz"
        interval = "10s"
        timeout  = "3s"

        check_restart {
          limit = 3
          grace = "60s"
        }
      }
    }

    scaling {
      enabled = true
      min     = 1
      max     = 4

      policy {
        evaluation_interval = "30s"
        cooldown            = "2m"

        # ceil(lag / 20): KEDA's AverageValue rule, 20 messages of lag per allocation.
        check "judge-cases" {
          source       = "prometheus"
          query        = "ceil((max(jetstream_consumer_num_pending{stream_name=\"CASES\",consumer_name=\"judge-cases\",is_consumer_leader=\"true\"}) + max(jetstream_consumer_num_ack_pending{stream_name=\"CASES\",consumer_name=\"judge-cases\",is_consumer_leader=\"true\"})) / 20) or vector(0)"
          query_window = "1m"
          on_error     = "ignore"

          strategy "pass-through" {}
        }
      }
    }

    task "judge" {
      driver = "docker"

      # Longer than SHUTDOWN_TIMEOUT_S (60 s): in-flight work finishes before SIGKILL.
      kill_signal  = "SIGTERM"
      kill_timeout = "75s"

      config {
        image = var.image
        ports = ["http"]
      }

      env {
        LOG_LEVEL                = "INFO"
        LOG_FORMAT               = "json"
        HTTP_HOST                = "0.0.0.0"
        HTTP_PORT                = "8080"
        SHUTDOWN_TIMEOUT_S       = "30"
        EVALBUS_STATE_DIR        = "/var/lib/evalbus"
        JUDGE_SHUTDOWN_TIMEOUT_S = "60"
      }

      # NATS_URL holds this service's NATS user and password (deploy/nats/accounts.conf).
      template {
        data = <<-EOT
        {{ with nomadVar "nomad/jobs/evalbus-judge" }}
        NATS_URL={{ .nats_url }}
        {{ end }}
        EOT
        destination = "secrets/evalbus.env"
        env         = true
        change_mode = "restart"
      }

      resources {
        cpu        = 500
        memory     = 256
        memory_max = 1024
      }
    }
  }
}
