# evalbus-exporter on Nomad. The exporter: sends judged cases to their sinks (exporter-cases); EXPORTER_GLOBAL_LIMIT (2)
# bounds the useful allocations. jsonl files go to EXPORTER_EXPORT_DIR (mount a shared volume there
# to keep them).
#
#   nomad var put nomad/jobs/evalbus-exporter nats_url=...
#   nomad job run -var image=registry.example.com/evalbus/exporter:0.1.0 deploy/nomad/evalbus-exporter.nomad.hcl
#
# Credentials come from the job's Nomad Variable, never from this file. Scaled by the Nomad
# Autoscaler on its consumers' lag, read from Prometheus (the NATS exporter of deploy/nomad/nats).

variable "image" {
  type        = string
  description = "The evalbus-exporter image (deploy/docker/exporter.Dockerfile)."
  default     = "evalbus/exporter:0.1.0"
}

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

job "evalbus-exporter" {
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

  group "exporter" {
    count = 1

    network {
      port "http" {
        to = 8080
      }
    }

    service {
      name     = "evalbus-exporter"
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
      max     = 2

      policy {
        evaluation_interval = "30s"
        cooldown            = "2m"

        # ceil(lag / 20): KEDA's AverageValue rule, 20 messages of lag per allocation.
        check "exporter-cases" {
          source       = "prometheus"
          query        = "ceil((max(jetstream_consumer_num_pending{stream_name=\"CASES\",consumer_name=\"exporter-cases\",is_consumer_leader=\"true\"}) + max(jetstream_consumer_num_ack_pending{stream_name=\"CASES\",consumer_name=\"exporter-cases\",is_consumer_leader=\"true\"})) / 20) or vector(0)"
          query_window = "1m"
          on_error     = "ignore"

          strategy "pass-through" {}
        }
      }
    }

    task "exporter" {
      driver = "docker"

      # Longer than SHUTDOWN_TIMEOUT_S (30 s): in-flight work finishes before SIGKILL.
      kill_signal  = "SIGTERM"
      kill_timeout = "45s"

      config {
        image = var.image
        ports = ["http"]
      }

      env {
        LOG_LEVEL           = "INFO"
        LOG_FORMAT          = "json"
        HTTP_HOST           = "0.0.0.0"
        HTTP_PORT           = "8080"
        SHUTDOWN_TIMEOUT_S  = "30"
        EVALBUS_STATE_DIR   = "/var/lib/evalbus"
        EXPORTER_EXPORT_DIR = "/var/lib/evalbus/exports"
      }

      # NATS_URL holds this service's NATS user and password (deploy/nats/accounts.conf).
      template {
        data = <<-EOT
        {{ with nomadVar "nomad/jobs/evalbus-exporter" }}
        NATS_URL={{ .nats_url }}
        {{ end }}
        EOT
        destination = "secrets/evalbus.env"
        env         = true
        change_mode = "restart"
      }

      resources {
        cpu        = 200
        memory     = 256
        memory_max = 512
      }
    }
  }
}
