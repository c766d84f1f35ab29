# evalbus-dispatcher on Nomad. The dispatcher: fans batches out (dispatcher-batches) and runs each case's harness inside
# this task (dispatcher-cases), DISPATCHER_SLOTS sandboxes at a time.
#
#   nomad var put nomad/jobs/evalbus-dispatcher nats_url=...
#   nomad job run -var image=registry.example.com/evalbus/dispatcher:0.1.0 deploy/nomad/evalbus-dispatcher.nomad.hcl
#
# Credentials come from the job's Nomad Variable, never from this file. Scaled by the Nomad
# Autoscaler on its consumers' lag, read from Prometheus (the NATS exporter of deploy/nomad/nats).

variable "image" {
  type        = string
  description = "The evalbus-dispatcher image (deploy/docker/dispatcher.Dockerfile)."
  default     = "evalbus/dispatcher:0.1.0"
}

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

job "evalbus-dispatcher" {
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

  group "dispatcher" {
    count = 1

    network {
      port "http" {
        to = 8080
      }
    }

    service {
      name     = "evalbus-dispatcher"
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
      max     = 20

      policy {
        evaluation_interval = "30s"
        cooldown            = "2m"

        # ceil(lag / 8): KEDA's AverageValue rule, 8 messages of lag per allocation.
        check "dispatcher-cases" {
          source       = "prometheus"
          query        = "ceil((max(jetstream_consumer_num_pending{stream_name=\"CASES\",consumer_name=\"dispatcher-cases\",is_consumer_leader=\"true\"}) + max(jetstream_consumer_num_ack_pending{stream_name=\"CASES\",consumer_name=\"dispatcher-cases\",is_consumer_leader=\"true\"})) / 8) or vector(0)"
          query_window = "1m"
          on_error     = "ignore"

          strategy "pass-through" {}
        }

        # ceil(lag / 10): KEDA's AverageValue rule, 10 messages of lag per allocation.
        check "dispatcher-batches" {
          source       = "prometheus"
          query        = "ceil((max(jetstream_consumer_num_pending{stream_name=\"CASES\",consumer_name=\"dispatcher-batches\",is_consumer_leader=\"true\"}) + max(jetstream_consumer_num_ack_pending{stream_name=\"CASES\",consumer_name=\"dispatcher-batches\",is_consumer_leader=\"true\"})) / 10) or vector(0)"
          query_window = "1m"
          on_error     = "ignore"

          strategy "pass-through" {}
        }
      }
    }

    task "dispatcher" {
      driver = "docker"

      # Longer than SHUTDOWN_TIMEOUT_S (120 s): in-flight work finishes before SIGKILL.
      kill_signal  = "SIGTERM"
      kill_timeout = "150s"

      config {
        image = var.image
        ports = ["http"]
      }

      env {
        LOG_LEVEL                     = "INFO"
        LOG_FORMAT                    = "json"
        HTTP_HOST                     = "0.0.0.0"
        HTTP_PORT                     = "8080"
        SHUTDOWN_TIMEOUT_S            = "30"
        EVALBUS_STATE_DIR             = "/var/lib/evalbus"
        DISPATCHER_SLOTS              = "4"
        DISPATCHER_WORKDIR_ROOT       = "/var/lib/evalbus/work"
        DISPATCHER_SHUTDOWN_TIMEOUT_S = "120"
      }

      # NATS_URL holds this service's NATS user and password (deploy/nats/accounts.conf); the
      # optional runner_auth_url and runner_auth_seed let it answer its case jobs' runners' logins
      # (run tokens, docs/backends.md, "The live view straight to NATS").
      template {
        data = <<-EOT
        {{ with nomadVar "nomad/jobs/evalbus-dispatcher" }}
        NATS_URL={{ .nats_url }}
        {{ with .runner_auth_url }}DISPATCHER_RUNNER_AUTH_URL={{ . }}{{ end }}
        {{ with .runner_auth_seed }}DISPATCHER_RUNNER_AUTH_SEED={{ . }}{{ end }}
        {{ end }}
        EOT
        destination = "secrets/evalbus.env"
        env         = true
        change_mode = "restart"
      }

      resources {
        cpu        = 2000
        memory     = 1024
        memory_max = 4096
      }
    }
  }
}
