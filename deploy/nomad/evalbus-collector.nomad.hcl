# evalbus-collector on Nomad. The collector: control-plane trace collection (collector-cases), the OTLP/HTTP receiver
# (port otlp, service evalbus-collector-otlp) and online sampling.
#
#   nomad var put nomad/jobs/evalbus-collector nats_url=...
#   nomad job run -var image=registry.example.com/evalbus/collector:0.1.0 deploy/nomad/evalbus-collector.nomad.hcl
#
# Credentials come from the job's Nomad Variable, never from this file. Scaled by the Nomad
# Autoscaler on its consumers' lag, read from Prometheus (the NATS exporter of deploy/nomad/nats).

variable "image" {
  type        = string
  description = "The evalbus-collector image (deploy/docker/collector.Dockerfile)."
  default     = "evalbus/collector:0.1.0"
}

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

job "evalbus-collector" {
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

  group "collector" {
    count = 1

    network {
      port "http" {
        to = 8080
      }
      port "otlp" {
        static = 4318
        to     = 4318
      }
    }

    service {
      name     = "evalbus-collector"
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

    # The OTLP/HTTP traces receiver: applications export to http://<this address>:4318/v1/traces.
    service {
      name     = "evalbus-collector-otlp"
      port     = "otlp"
      provider = "nomad"
    }

    scaling {
      enabled = true
      min     = 1
      max     = 10

      policy {
        evaluation_interval = "30s"
        cooldown            = "2m"

        # ceil(lag / 64): KEDA's AverageValue rule, 64 messages of lag per allocation.
        check "collector-cases" {
          source       = "prometheus"
          query        = "ceil((max(jetstream_consumer_num_pending{stream_name=\"CASES\",consumer_name=\"collector-cases\",is_consumer_leader=\"true\"}) + max(jetstream_consumer_num_ack_pending{stream_name=\"CASES\",consumer_name=\"collector-cases\",is_consumer_leader=\"true\"})) / 64) or vector(0)"
          query_window = "1m"
          on_error     = "ignore"

          strategy "pass-through" {}
        }

        # ceil(lag / 256): KEDA's AverageValue rule, 256 messages of lag per allocation.
        check "collector-observations" {
          source       = "prometheus"
          query        = "ceil((max(jetstream_consumer_num_pending{stream_name=\"OBSERVATIONS\",consumer_name=\"collector-observations\",is_consumer_leader=\"true\"}) + max(jetstream_consumer_num_ack_pending{stream_name=\"OBSERVATIONS\",consumer_name=\"collector-observations\",is_consumer_leader=\"true\"})) / 256) or vector(0)"
          query_window = "1m"
          on_error     = "ignore"

          strategy "pass-through" {}
        }
      }
    }

    task "collector" {
      driver = "docker"

      # Longer than SHUTDOWN_TIMEOUT_S (30 s): in-flight work finishes before SIGKILL.
      kill_signal  = "SIGTERM"
      kill_timeout = "45s"

      config {
        image = var.image
        ports = ["http", "otlp"]
      }

      env {
        LOG_LEVEL           = "INFO"
        LOG_FORMAT          = "json"
        HTTP_HOST           = "0.0.0.0"
        HTTP_PORT           = "8080"
        SHUTDOWN_TIMEOUT_S  = "30"
        EVALBUS_STATE_DIR   = "/var/lib/evalbus"
        COLLECTOR_OTLP_HOST = "0.0.0.0"
        COLLECTOR_OTLP_PORT = "4318"
      }

      # NATS_URL holds this service's NATS user and password (deploy/nats/accounts.conf).
      template {
        data = <<-EOT
        {{ with nomadVar "nomad/jobs/evalbus-collector" }}
        NATS_URL={{ .nats_url }}
        {{ end }}
        EOT
        destination = "secrets/evalbus.env"
        env         = true
        change_mode = "restart"
      }

      resources {
        cpu        = 500
        memory     = 512
        memory_max = 2048
      }
    }
  }
}
